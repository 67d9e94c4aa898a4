"""Functional optimizers: SGD (momentum), Adam(W) and Adafactor; float16's dynamic loss scaling.

`opt.init(params)` makes the state (`"step"` and a dict per slot); `opt.update(params, grads,
state)` returns `(new_params, new_state)` and mutates nothing. Each state tensor is laid out like
its parameter; learning rates may be schedules `f(t)`; 16-bit parameters update in float32.
Details, and Adafactor's formulas: docs/optimizers.md.

>>> import numpy as np, mpimesh as mm
>>> mesh = mm.Mesh("all:1", comm=mm.MPI.COMM_SELF)
>>> params = {"w": mesh.from_numpy(np.array([1.0, 2.0]), "a:2")}
>>> grads, opt = {"w": mesh.from_numpy(np.array([0.5, -1.0]), "a:2")}, mm.optim.SGD(0.1, momentum=0.9)
>>> params, state = opt.update(params, grads, opt.init(params))
>>> params["w"].to_numpy().tolist(), int(state["step"].to_numpy()), sorted(state)
([0.95, 2.1], 1, ['step', 'v'])
"""
from __future__ import annotations

import math
import numbers
from typing import Callable, Mapping, Optional, Union

import numpy as np

from .backend import accumulation_dtype, is_float
from .errors import DTypeError, MeshError, MpimeshError, ShapeError
from .mesh import layout_scope
from .ops.einsum import einsum
from .ops.elementwise import abs as abs_
from .ops.elementwise import cast, equal, greater_equal, less, maximum, minimum, rsqrt, sqrt, square, where
from .ops.reduce import reduce_mean, reduce_min, reduce_sum
from .ops.relayout import to_layout
from .ops.adafactor import adafactor_update
from .ops.updates import TENSOR_OPS, adam_step, adam_update, sgd_step, sgd_update
from .shape import Dimension, Shape
from .tensor import DistTensor, full

Schedule = Union[float, Callable]
__all__ = ["Optimizer", "SGD", "Adam", "Adafactor", "DynamicLossScale"]


def _mean_square(x, keep: Shape = Shape(())):
    """mean(x**2) over x's dims but those of `keep` (default all: a 0-d tensor), as an einsum of x
    with itself: one read of x and no x**2 array (a dot product for the whole of x)."""
    return einsum([x, x], output_shape=keep) * (1.0 / math.prod(d.size for d in x.shape if d.name not in keep))


def _rms(x):
    """sqrt(mean(x**2)) over all of x: a 0-d tensor."""
    return sqrt(_mean_square(x))


_RULES = {">= 0": lambda x: x >= 0, "> 0": lambda x: x > 0, ">= 1": lambda x: x >= 1,
          "in [0, 1)": lambda x: 0 <= x < 1, "in (0, 1)": lambda x: 0 < x < 1}
_SCHEDULED = {"lr": ">= 0", "learning_rate": ">= 0", "decay_rate": "in [0, 1)"}
"""The rule each hyperparameter that may be a schedule follows, its schedule's values too."""


def _hyper(owner: str, arg: str, value, rule: str, *, schedule: bool = False, optional: bool = False,
           integer: bool = False, mesh=None):
    """Hyperparameter `arg` of `owner`, checked: a real number (an int where `integer`; never a
    bool), finite and `rule` (a key of `_RULES`), returned as a float (an int). Returned as they
    are: a callable where `schedule`, None where `optional`, a 0-d float DistTensor on `mesh` where
    one is given (a schedule's value). Anything else: a TypeError, ShapeError, DTypeError,
    MeshError or MpimeshError naming `owner`, `arg` and the value."""
    if schedule and callable(value) or optional and value is None:
        return value
    if mesh is not None and isinstance(value, DistTensor):
        if value.shape.rank:
            raise ShapeError(f"{owner}: {arg} must be 0-d, got a tensor of shape {value.shape}")
        if not is_float(value.dtype):
            raise DTypeError(f"{owner}: {arg} must be a float, got a tensor of dtype {value.dtype}")
        if value.mesh is not mesh:
            raise _other_mesh(f"{owner}: {arg}", value.mesh, "the params", mesh)
        return value
    if isinstance(value, bool) or not isinstance(value, numbers.Integral if integer else numbers.Real):
        forms = (["an int" if integer else "a real number"] + ["a schedule f(t)"] * schedule + ["None"] * optional
                 + ["a 0-d float DistTensor"] * (mesh is not None))
        raise TypeError(f"{owner}: {arg} must be {' or '.join(forms)}, got {value!r} ({type(value).__name__})")
    if not ((integer or _finite(value)) and _RULES[rule](value)):
        raise MpimeshError(f"{owner}: {arg} must be {'an int' if integer else 'a finite number'} {rule}, "
                           f"got {value!r}")
    return int(value) if integer else float(value)


def _finite(value) -> bool:
    """Whether a real number is finite as a float (an int past 1.8e308 is not: float() overflows)."""
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


def _value(opt: "Optimizer", arg: str, t):
    """`opt`'s hyperparameter `arg` at step `t`: its number, or its schedule's value, checked."""
    v = getattr(opt, arg)
    if not callable(v):
        return v
    return _hyper(type(opt).__name__, f"the value of the {arg} schedule", v(t), _SCHEDULED[arg], mesh=t.mesh)


def _sub_layout(p: DistTensor, shape: Shape) -> tuple:
    """The tensor layout of `shape` (a subset of p's dims) that p's layout gives it."""
    return tuple(p.tensor_layout[p.shape.index(n)] for n in shape.names)


def _other_mesh(a: str, mesh_a, b: str, mesh_b) -> MeshError:
    """The error for tensors `a` and `b` of one update on two Mesh objects."""
    where = (f"two different Mesh objects of the same shape ({mesh_a})" if mesh_a.shape == mesh_b.shape
             else f"different meshes ({mesh_a} and {mesh_b})")
    return MeshError(f"{a} and {b} live on {where}; an update's tensors must all be on one Mesh object")


def _check_params(params: Mapping):
    """The one mesh every tensor of `params` lives on; every one a float tensor."""
    if not isinstance(params, Mapping) or not params:
        raise MpimeshError(f"params must be a non-empty dict of DistTensors, got {type(params).__name__}")
    first = next(iter(params))
    for name, p in params.items():
        if not isinstance(p, DistTensor):
            raise TypeError(f"params[{name!r}] is a {type(p).__name__}, not a DistTensor")
        if not is_float(p.dtype):
            raise DTypeError(f"params[{name!r}] has dtype {p.dtype}: an optimizer updates float params only")
        if p.mesh is not params[first].mesh:
            raise _other_mesh(f"params[{first!r}]", params[first].mesh, f"params[{name!r}]", p.mesh)
    return params[first].mesh


def _named(t: DistTensor, default: str) -> str:
    """`t` named as its checkpoint holds it ("tensor 'state/m/w' loaded from checkpoint '/ck'"), else `default`."""
    return f"tensor {t.origin[1]!r} loaded from checkpoint {t.origin[0]!r}" if t.origin else default


def _loaded(t: DistTensor) -> str:
    """Where `t` was loaded from, as the end of a message ("" if it was not)."""
    return f" ({_named(t, '')}: the checkpoint was saved for another model)" if t.origin else ""


class Optimizer:
    """Base class: subclasses define `_slot_shapes(p)` and `_apply(p, g, slots, t)`."""

    slot_names: tuple = ()
    """The names of the state a parameter may have, each a key of `init`'s state (holding a
    `{parameter name: tensor}` dict): `("m", "v")` for Adam, `()` for SGD without momentum."""

    def _slot_shapes(self, p: DistTensor) -> dict[str, Shape]:
        """{slot name: shape} of the state this parameter needs (dims a subset of p's)."""
        return {}

    def _apply(self, p, g, slots: dict, t) -> tuple:
        """One update of one parameter: `(new_p, {slot: new value})`, inside p's layout scope."""
        raise NotImplementedError

    def init(self, params: Mapping[str, DistTensor]) -> dict:
        """Zero state for `params`, each tensor laid out like its parameter; step 0."""
        mesh = _check_params(params)
        state: dict = {"step": full(mesh, Shape(()), 0, "int32", ())}
        for s in self.slot_names:
            state[s] = {}
        for name, p in params.items():
            for s, shape in self._slot_shapes(p).items():
                state[s][name] = full(mesh, shape, 0, accumulation_dtype(p.dtype), _sub_layout(p, shape))
        return state

    def update(self, params: Mapping[str, DistTensor], grads: Mapping[str, Optional[DistTensor]],
               state: Mapping) -> tuple[dict, dict]:
        """Apply one step: `(new_params, new_state)`, each tensor in its parameter's layout."""
        mesh = self._check(params, grads, state)
        step = state["step"] + 1
        if self._update_all is not None:  # one op for all parameters of a dtype
            return self._fused(params, grads, state, step)
        times: dict = {}  # the step as a float tensor, one per parameter dtype
        new_params: dict = {}
        new_state: dict = {"step": step}
        for s in self.slot_names:
            new_state[s] = dict(state.get(s, {}))
        for name, p in params.items():
            g = grads[name]
            if g is None:
                new_params[name] = p
                continue
            work = accumulation_dtype(p.dtype)  # float32 for a 16-bit float parameter
            t = times.get(work)
            if t is None:
                t = times[work] = cast(step, work)
            with layout_scope(mesh, p.layout):
                slots = {s: state[s][name] for s in self._slot_shapes(p)}
                new_p, new_slots = self._apply(cast(p, work), cast(g, work), slots, t)
                new_p = cast(new_p, p.dtype)
            new_params[name] = to_layout(new_p, p.tensor_layout)
            for s, v in new_slots.items():
                new_state[s][name] = to_layout(v, _sub_layout(p, v.shape))
        return new_params, new_state

    _update_all = None
    """`(groups, t) -> outputs`: the update of every parameter of one working dtype as one op
    (`mpimesh.ops.updates`), in a subclass that has one; None: `_apply`, op by op."""

    def _fused(self, params: Mapping, grads: Mapping, state: Mapping, step) -> tuple[dict, dict]:
        """`update` through `_update_all`: parameters grouped by the dtype they update in."""
        new_params: dict = {}
        new_state: dict = {"step": step, **{s: dict(state.get(s, {})) for s in self.slot_names}}
        slots = {n: list(self._slot_shapes(p)) for n, p in params.items()}  # each parameter's, in order
        groups: dict = {}
        for name, p in params.items():
            if grads[name] is None:
                new_params[name] = p
            else:
                groups.setdefault(accumulation_dtype(p.dtype), []).append(name)
        for work, names in groups.items():
            t = cast(step, work)
            tensors = [(params[n], grads[n], *(state[s][n] for s in slots[n])) for n in names]
            for n, (new_p, *values) in zip(names, self._update_all(tensors, t, work)):
                new_params[n] = new_p
                for s, v in zip(slots[n], values):
                    new_state[s][n] = v
        return {n: new_params[n] for n in params}, new_state

    def _check(self, params: Mapping, grads: Mapping, state: Mapping):
        """Every error from names, shapes, dtypes and meshes (identical on all ranks), before any op runs."""
        mesh = _check_params(params)
        opt = type(self).__name__
        if not isinstance(grads, Mapping):
            raise MpimeshError(f"grads must be a dict of DistTensors, got {type(grads).__name__}")
        if set(params) != set(grads):
            missing = sorted(set(params) - set(grads))
            extra = sorted(set(grads) - set(params))
            raise MpimeshError(f"params and grads must have the same keys: params without a gradient: "
                               f"{missing}; gradients without a param: {extra}")
        for name, p in params.items():
            g = grads[name]
            if g is None:
                continue
            if not isinstance(g, DistTensor):
                raise TypeError(f"grads[{name!r}] is a {type(g).__name__}, not a DistTensor")
            if g.shape != p.shape:
                raise ShapeError(f"the gradient of param {name!r} has shape {g.shape}, "
                                 f"but the param has shape {p.shape}")
            if not is_float(g.dtype):
                raise DTypeError(f"the gradient of param {name!r} has dtype {g.dtype}: gradients must be floats")
            if g.mesh is not mesh:
                raise _other_mesh(f"grads[{name!r}]", g.mesh, f"params[{name!r}]", mesh)
        if not isinstance(state, Mapping) or "step" not in state:
            raise MpimeshError(f"{opt} state must be the dict made by init(), with a 'step'")
        step = state["step"]
        if not isinstance(step, DistTensor):
            raise TypeError(f"{opt} state['step'] must be a DistTensor (the 0-d int32 tensor init() makes; "
                            f"restore it as one), got {step!r} ({type(step).__name__})")
        if step.shape.rank:
            raise ShapeError(f"{opt} state['step'] has shape {step.shape}, expected a 0-d tensor, as init() makes")
        if step.dtype.kind not in "iu":
            raise DTypeError(f"{opt} state['step'] has dtype {step.dtype}, expected an int (init() makes int32)")
        if step.mesh is not mesh:
            raise _other_mesh(f"{opt} state['step']", step.mesh, "the params", mesh)
        for name, p in params.items():
            for s, shape in self._slot_shapes(p).items():
                v = state.get(s, {}).get(name)
                where = f"{opt} state slot {s!r} of param {name!r}"
                if v is None:
                    raise MpimeshError(f"{opt} state has no slot {s!r} for param {name!r} "
                                       f"(shape {p.shape}); make the state with init(params)")
                if not isinstance(v, DistTensor):
                    raise TypeError(f"{where} is a {type(v).__name__}, not a DistTensor")
                if v.shape != shape and (v.origin or p.origin):  # blame the checkpoint, not the optimizer
                    needs = "has" if shape == p.shape else f"has {p.shape}, which needs"
                    raise ShapeError(f"{where}: {_named(v, 'the state')} has shape {v.shape}, but "
                                     f"{_named(p, f'parameter {name!r}')} {needs} {shape}: the checkpoint was "
                                     f"saved for another model (or pass shapes= to mm.load to check at load time)")
                if v.shape != shape:
                    raise ShapeError(f"{where} has shape {v.shape}, expected {shape}")
                if v.dtype != accumulation_dtype(p.dtype):
                    raise DTypeError(f"{where} has dtype {v.dtype}, expected {accumulation_dtype(p.dtype)} "
                                     f"(the param's is {p.dtype}){_loaded(v)}")
                if v.mesh is not mesh:
                    raise _other_mesh(where, v.mesh, f"params[{name!r}]", mesh)
        return mesh


class SGD(Optimizer):
    """Stochastic gradient descent with (heavy-ball) momentum.

        v <- momentum * v + g        (slot "v"; no state at all when momentum == 0)
        p <- p - lr * v
    """

    def __init__(self, lr: Schedule, momentum: float = 0.0):
        lr = _hyper("SGD", "lr", lr, _SCHEDULED["lr"], schedule=True)
        momentum = _hyper("SGD", "momentum", momentum, "in [0, 1)")
        self.lr, self.momentum = lr, momentum
        self.slot_names = ("v",) if momentum else ()

    def _slot_shapes(self, p):
        return {"v": p.shape} if self.momentum else {}

    def _apply(self, p, g, slots, t):
        new_p, v = sgd_step(TENSOR_OPS, p, g, slots.get("v"), -_value(self, "lr", t), self.momentum)
        return new_p, ({"v": v} if self.momentum else {})

    def _update_all(self, groups, t, work):
        return sgd_update(groups, _value(self, "lr", t), self.momentum, work)


class Adam(Optimizer):
    """Adam (Kingma & Ba) with bias correction, and decoupled weight decay (AdamW, Loshchilov & Hutter).

    With t the 1-based step:

        m <- beta1 * m + (1 - beta1) * g                       (slot "m")
        v <- beta2 * v + (1 - beta2) * g**2                    (slot "v")
        p <- p - lr * (m / (1 - beta1**t)) / (sqrt(v / (1 - beta2**t)) + epsilon)
               - lr * weight_decay * p                         (p: the value before this step)
    """

    slot_names = ("m", "v")

    def __init__(self, lr: Schedule, beta1: float = 0.9, beta2: float = 0.999, epsilon: float = 1e-8,
                 weight_decay: float = 0.0):
        lr = _hyper("Adam", "lr", lr, _SCHEDULED["lr"], schedule=True)
        beta1, beta2 = _hyper("Adam", "beta1", beta1, "in [0, 1)"), _hyper("Adam", "beta2", beta2, "in [0, 1)")
        epsilon = _hyper("Adam", "epsilon", epsilon, ">= 0")
        weight_decay = _hyper("Adam", "weight_decay", weight_decay, ">= 0")
        self.lr, self.beta1, self.beta2 = lr, beta1, beta2
        self.epsilon, self.weight_decay = epsilon, weight_decay

    def _slot_shapes(self, p):
        return {"m": p.shape, "v": p.shape}

    def _apply(self, p, g, slots, t):
        b1, b2 = self.beta1, self.beta2
        lr = _value(self, "lr", t)
        new_p, m, v = adam_step(TENSOR_OPS, p, g, slots["m"], slots["v"], 1.0 - b1 ** t, 1.0 - b2 ** t, -lr,
                                -(lr * self.weight_decay) if self.weight_decay else None, b1, b2, self.epsilon)
        return new_p, {"m": m, "v": v}

    def _update_all(self, groups, t, work):
        return adam_update(groups, t, _value(self, "lr", t), self.beta1, self.beta2, self.epsilon, self.weight_decay,
                           work)


class Adafactor(Optimizer):
    """Adafactor (Shazeer & Stern 2018) with Mesh-TensorFlow's defaults: the second moment of a
    parameter with >= 2 dims is factored into row and column means over its two largest dims (slots
    "vr", "vc"; else "v"), the update is clipped by its RMS (`clipping_threshold`) and scaled by the
    parameter's RMS (`multiply_by_parameter_scale`); `beta1 > 0` adds momentum (slot "m"). The update
    written out: docs/optimizers.md.

    >>> import mpimesh as mm
    >>> mesh = mm.Mesh("all:1", comm=mm.MPI.COMM_SELF)
    >>> state = Adafactor(min_dim_size_to_factor=2).init({"w": mesh.ones("a:3;b:2")})
    >>> state["vr"]["w"].shape, state["vc"]["w"].shape, state["v"]
    (Shape('[b:2]'), Shape('[a:3]'), {})
    """

    def __init__(self, learning_rate: Optional[Schedule] = None, decay_rate: Optional[Schedule] = None,
                 beta1: float = 0.0, clipping_threshold: Optional[float] = 1.0,
                 multiply_by_parameter_scale: bool = True, factored: bool = True,
                 epsilon1: float = 1e-30, epsilon2: float = 1e-3, min_dim_size_to_factor: int = 128):
        learning_rate = _hyper("Adafactor", "learning_rate", learning_rate, _SCHEDULED["learning_rate"],
                               schedule=True, optional=True)
        decay_rate = _hyper("Adafactor", "decay_rate", decay_rate, _SCHEDULED["decay_rate"], schedule=True,
                            optional=True)
        beta1 = _hyper("Adafactor", "beta1", beta1, "in [0, 1)")
        epsilon1 = _hyper("Adafactor", "epsilon1", epsilon1, ">= 0")
        epsilon2 = _hyper("Adafactor", "epsilon2", epsilon2, ">= 0")
        for arg, flag in (("multiply_by_parameter_scale", multiply_by_parameter_scale), ("factored", factored)):
            if not isinstance(flag, (bool, np.bool_)):
                raise TypeError(f"Adafactor: {arg} must be True or False, got {flag!r} ({type(flag).__name__})")
        self.learning_rate, self.decay_rate, self.beta1 = learning_rate, decay_rate, beta1
        self.clipping_threshold = _hyper("Adafactor", "clipping_threshold", clipping_threshold, "> 0", optional=True)
        """Update clipping: `u` is divided by `max(1, RMS(u) / clipping_threshold)`; None: no clipping."""
        self.multiply_by_parameter_scale, self.factored = bool(multiply_by_parameter_scale), bool(factored)
        self.epsilon1, self.epsilon2 = epsilon1, epsilon2
        self.min_dim_size_to_factor = _hyper("Adafactor", "min_dim_size_to_factor", min_dim_size_to_factor, ">= 1",
                                             integer=True)
        """The second moment is factored only where a parameter's second-largest dim is at least this."""
        self.slot_names = ("vr", "vc", "v") + (("m",) if beta1 else ())

    def factored_dims(self, shape: Shape) -> Optional[tuple[Dimension, Dimension]]:
        """The two largest dims `(d0, d1)` if the second moment of `shape` is factored, else None."""
        shape = Shape(shape)
        if not self.factored or shape.rank < 2:
            return None
        d0, d1 = sorted(shape.dims, key=lambda d: -d.size)[:2]
        return (d0, d1) if d1.size >= self.min_dim_size_to_factor else None

    def _slot_shapes(self, p):
        dims = self.factored_dims(p.shape)
        out = ({"vr": p.shape.without([dims[0].name]), "vc": p.shape.without([dims[1].name])}
               if dims else {"v": p.shape})
        if self.beta1:
            out["m"] = p.shape
        return out

    def _rates(self, t):
        lr = self.learning_rate
        if lr is None:
            lr = minimum(rsqrt(t), 0.01)
            if not self.multiply_by_parameter_scale:
                lr = lr * 0.05
        else:
            lr = _value(self, "learning_rate", t)
        decay = 1.0 - t ** -0.8 if self.decay_rate is None else _value(self, "decay_rate", t)
        return lr, decay

    def _apply(self, p, g, slots, t):
        # Passes over p-sized arrays are what this costs: RMS values and row/column means of g**2
        # are einsums of a tensor with itself (no squared copy), and the scalars (learning rate,
        # parameter scale, clipping) are combined before they meet u.
        lr, decay = self._rates(t)
        scale = lr * maximum(_rms(p), self.epsilon2) if self.multiply_by_parameter_scale else lr
        dims = self.factored_dims(p.shape)
        new: dict = {}
        if dims:  # mean over d of g**2 + epsilon1 is mean over d of g**2, plus epsilon1
            d0, d1 = dims
            vr = slots["vr"]
            vr = decay * vr + (1.0 - decay) * (_mean_square(g, vr.shape) + self.epsilon1)
            vc = slots["vc"]
            vc = decay * vc + (1.0 - decay) * (_mean_square(g, vc.shape) + self.epsilon1)
            # g times the outer product of the two small factors: a p-sized product written once by
            # einsum, then one multiply of two p-sized arrays (broadcasting a row vector over a large
            # array is the slowest case of a numpy multiply)
            u = g * einsum([rsqrt(vr / reduce_mean(vr, reduced_dims=d1.name)), rsqrt(vc)], output_shape=p.shape)
            new.update(vr=vr, vc=vc)
        else:
            v = decay * slots["v"] + (1.0 - decay) * (square(g) + self.epsilon1)
            u = g / sqrt(v)
            new["v"] = v
        if self.clipping_threshold is not None:
            scale = scale / maximum(_rms(u) * (1.0 / self.clipping_threshold), 1.0)
        d = u * scale
        if self.beta1:
            d = self.beta1 * slots["m"] + (1.0 - self.beta1) * d
            new["m"] = d
        return p - d, new

    def _update_all(self, groups, t, work):
        lr, decay = self._rates(t)
        dims = [self.factored_dims(g[0].shape) for g in groups]
        return adafactor_update(groups, [d and (d[0].name, d[1].name) for d in dims], lr, decay, self.beta1,
                                self.clipping_threshold, self.multiply_by_parameter_scale, self.epsilon1,
                                self.epsilon2, work)


def _held_scale(state) -> Optional[dict]:
    """`state["loss_scale"]` (`DynamicLossScale.init`'s tensors), or None in the Python mode."""
    if not isinstance(state, Mapping) or "loss_scale" not in state:
        return None
    held = state["loss_scale"]
    if not (isinstance(held, Mapping) and all(isinstance(held.get(k), DistTensor) and not held[k].shape.rank
                                              for k in ("scale", "good_steps"))):
        raise MpimeshError("DynamicLossScale: state['loss_scale'] must be the dict init() makes: "
                           "{'scale': a 0-d float32 tensor, 'good_steps': a 0-d int32 tensor}")
    return held


def _keep_unless(ok) -> Callable:
    """`keep(new, old)`: new where `ok` (a 0-d bool tensor), else old, for dicts of tensors alike
    (each in old's layout)."""
    def keep(new, old):
        if isinstance(new, Mapping):
            return {k: keep(v, old[k]) for k, v in new.items()}
        return to_layout(where(ok, new, old), old.tensor_layout)
    return keep


class DynamicLossScale:
    """Dynamic loss scaling for float16 training (as in PyTorch's `GradScaler`): multiply the loss by
    `scale` (`scaled(loss)`) before `mm.gradients`; `step(...)` unscales the gradients and applies the
    optimizer when all are finite on every rank, else skips the step and multiplies `scale` by
    `backoff` (by `growth` after `interval` applied steps). The scale is a float or, for a compiled
    step, a tensor in the optimizer state (`init(state)`).

    >>> import numpy as np, mpimesh as mm
    >>> mesh = mm.Mesh("all:1", comm=mm.MPI.COMM_SELF)
    >>> params, opt = {"w": mesh.from_numpy(np.array([1.0, 2.0]), "a:2")}, SGD(0.5)
    >>> ls = DynamicLossScale(scale=4.0, interval=1)
    >>> steps = [ls.step(opt, params, {"w": mesh.from_numpy(np.array(g), "a:2")}, opt.init(params))
    ...          for g in ([np.inf, 0.0], [2.0, 4.0])]  # overflowed, then 2x the true gradient [1, 2]
    >>> [applied for _, _, applied in steps], ls.scale, steps[1][0]["w"].to_numpy().tolist()
    ([False, True], 4.0, [0.5, 1.0])
    """

    def __init__(self, scale: float = 2.0 ** 15, growth: float = 2.0, backoff: float = 0.5, interval: int = 200):
        scale = _hyper("DynamicLossScale", "scale", scale, "> 0")
        growth = _hyper("DynamicLossScale", "growth", growth, ">= 1")
        backoff = _hyper("DynamicLossScale", "backoff", backoff, "in (0, 1)")
        interval = _hyper("DynamicLossScale", "interval", interval, ">= 1", integer=True)
        self.scale, self.growth, self.backoff, self.interval = scale, growth, backoff, interval
        self.good_steps = 0
        """Steps applied in a row since the scale last changed (the scale grows when it reaches `interval`)."""

    def init(self, state: Mapping) -> dict:
        """An optimizer's `state` (from its `init`) with this scale in it as tensors, key
        `"loss_scale"`: `{"scale": float32 0-d, "good_steps": int32 0-d}`, from the current `scale`
        and `good_steps`. Given such a state, `scaled` and `step` read and update those tensors, not
        the Python attributes, and decide with no value read on the host: a skipped step is a
        `where` that keeps the old params and state, so a compiled step (`mm.compile`) scales and
        skips by itself, and the scale is saved and restored with the state. With power-of-two
        scales (the defaults), the values are those of the Python mode, bitwise."""
        step = state.get("step") if isinstance(state, Mapping) else None
        if not isinstance(step, DistTensor):
            raise MpimeshError(f"DynamicLossScale.init: state must be an optimizer's state (the dict its init() "
                               f"makes, with a 'step' tensor), got {type(state).__name__}")
        mesh = step.mesh
        return dict(state, loss_scale={"scale": full(mesh, Shape(()), self.scale, "float32", ()),
                                       "good_steps": full(mesh, Shape(()), self.good_steps, "int32", ())})

    def scaled(self, loss, state: Optional[Mapping] = None):
        """`loss * scale`, the value to differentiate (the scale in `state`, where `init` put one). A
        16-bit loss is scaled in float32 (2**16 is inf in float16, and so would be any loss times it); its
        gradient is still a 16-bit number, so a float16 loss caps the scale at 2**15: compute the loss
        in float32 (as PyTorch's autocast does) where scales should grow past that."""
        held = _held_scale(state)
        wide = cast(loss, accumulation_dtype(loss.dtype)) if isinstance(loss, DistTensor) else loss
        return wide * self.scale if held is None else wide * cast(held["scale"], wide.dtype)

    def finite(self, grads: Mapping) -> bool:
        """Whether every gradient is finite, agreed across all ranks of the mesh."""
        if not isinstance(grads, Mapping):
            raise TypeError(f"DynamicLossScale: grads must be a dict of DistTensors, got a {type(grads).__name__}")
        for name, g in grads.items():
            if g is not None and not isinstance(g, DistTensor):
                raise TypeError(f"DynamicLossScale: grads[{name!r}] is a {type(g).__name__}, not a DistTensor")
        mesh, total = None, None
        for g in grads.values():
            if g is None:
                continue
            mesh = g.mesh
            with np.errstate(invalid="ignore"):  # inf * 0: nan where g holds inf or nan
                probe = reduce_sum(cast(g, accumulation_dtype(g.dtype)) * 0.0)
                total = probe if total is None else total + probe
        bad = total is not None and not bool(np.isfinite(total.to_numpy()))  # (one read: one sync on a GPU)
        return mesh is None or not mesh.collectives.any_rank(bad)

    def step(self, optimizer: Optimizer, params: Mapping, grads: Mapping, state: Mapping) -> tuple:
        """`(params, state, applied)`: the optimizer's step on the unscaled gradients, or the inputs
        unchanged (`applied` False) when a gradient overflowed; the scale adapts either way."""
        if not isinstance(optimizer, Optimizer):
            raise TypeError(f"DynamicLossScale.step: optimizer must be an mm.optim.Optimizer, "
                            f"got a {type(optimizer).__name__}")
        held = _held_scale(state)
        if held is not None:
            return self._step_held(optimizer, params, grads, state, held)
        optimizer._check(params, grads, state)
        if not self.finite(grads):
            self.scale *= self.backoff
            self.good_steps = 0
            return dict(params), dict(state), False
        inv = 1.0 / self.scale
        new_params, new_state = optimizer.update(
            params, {k: None if g is None else cast(g, accumulation_dtype(g.dtype)) * inv for k, g in grads.items()},
            state)
        self.good_steps += 1
        if self.good_steps >= self.interval:
            self.scale *= self.growth
            self.good_steps = 0
        return new_params, new_state, True

    def _step_held(self, optimizer: Optimizer, params: Mapping, grads: Mapping, state: Mapping, held: dict) -> tuple:
        """`step` with the scale in `state` (see `init`): `applied` is a 0-d bool tensor."""
        inner = {k: v for k, v in state.items() if k != "loss_scale"}
        optimizer._check(params, grads, inner)
        scale, good = held["scale"], held["good_steps"]
        ok = self._all_finite(grads, scale)
        inv = 1.0 / scale
        new_params, new_state = optimizer.update(  # (zeros where a step is skipped: no inf / inf to warn of)
            params, {k: None if g is None else where(ok, cast(g, accumulation_dtype(g.dtype)) * inv, 0.0)
                     for k, g in grads.items()}, inner)
        keep = _keep_unless(ok)
        grown = greater_equal(good + 1, self.interval)
        held = {"scale": where(ok, where(grown, scale * self.growth, scale), scale * self.backoff),
                "good_steps": where(ok, where(grown, 0, good + 1), 0)}
        return keep(new_params, params), dict(keep(new_state, inner), loss_scale=held), ok

    @staticmethod
    def _all_finite(grads: Mapping, like) -> DistTensor:
        """A 0-d bool tensor, the same on every rank: whether every gradient is finite (|g| < inf:
        no inf - inf or inf * 0 to warn about)."""
        if not isinstance(grads, Mapping):
            raise TypeError(f"DynamicLossScale: grads must be a dict of DistTensors, got a {type(grads).__name__}")
        every = None
        for g in grads.values():
            if g is not None:
                ok = reduce_min(cast(less(abs_(g), np.inf), "float32"))  # (reduced over every split dim)
                every = ok if every is None else minimum(every, ok)
        return greater_equal(like, 0.0) if every is None else equal(every, 1.0)
