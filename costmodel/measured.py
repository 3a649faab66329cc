"""Measured times: the forward and backward seconds of a model's layer kinds (the
transformer layer, the embedding, the LM head with its loss) that `shardwise profile
--model` measured on a real device, read from the profile's JSON (never pickle),
validated field by field, and interpolated to the micro-batch sizes and TP widths the
search asks about. `unit_costs` (costmodel.estimate) uses them in place of the analytic
compute times of costmodel.terms.compute where they cover a shape, and the analytic model
elsewhere (`covers` says which).

Interpolation (`interpolate`), separable over the two axes the profile varies:
- along the micro-batch size b at one TP width, piecewise affine in b: above the GEMM
  efficiency knee a kernel's time is a fixed launch and tail cost plus a cost per unit
  of work (NVIDIA, "Matrix Multiplication Background" user guide: once the device is
  full, time grows linearly with the work, up to tile and wave quantization), and a
  layer's work at a fixed sequence length is proportional to b;
- across TP widths, piecewise affine in 1/tp: a TP shard runs 1/tp of the sharded GEMMs
  and the attention heads and all of the replicated norms and residuals (Shoeybi et al.
  2019 §3), so time = replicated + sharded / tp.
Between measured points this is the line through the two neighbours, so a measured shape
gets its measured time back. Beyond the measured micro-batch sizes the line through the
nearest two is extended, held between "no faster than the nearest point per unit of work"
and "no slower than the nearest point" (efficiency does not drop on a larger GEMM, and
time does not fall with more work), which also absorbs timer noise in a steep or flat
pair. A TP width outside the measured ones is not extrapolated: the analytic model
prices it.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from costmodel.specs import PRECISIONS, ClusterSpec, ModelSpec, TrainingSpec
from costmodel.specs.loading import SpecError, read_json_object
from costmodel.terms import compute

PROFILE_SCHEMA_VERSION = 2   # 2 added the layer kinds ("layers") and all_to_all
READABLE_SCHEMA_VERSIONS = (1, 2)
LAYER_KINDS = ("embedding", "layer", "head")
ATTENTION_KINDS = ("flash", "eager")
# The ModelSpec fields that shape one layer, the embedding or the head (a profile of a
# model applies to the same model with more or fewer layers, or under another name).
LAYER_DIMS = ("model_type", "hidden_size", "num_attention_heads", "num_key_value_heads",
              "intermediate_size", "vocab_size", "num_local_experts", "num_experts_per_tok")
# Written only when set, so profiles made before these fields existed still apply to the
# same models: name -> the value an older profile means by leaving it out.
OPTIONAL_LAYER_DIMS = {"shared_expert_intermediate_size": 0, "shared_expert_gate": False, "norm_topk_prob": True,
                       "windowed_layers": 0, "attention_window": None, "chunked_attention": False,
                       "attention_sinks": False, "router_bias": False, "swiglu_limit": None,
                       "router_scoring": "softmax"}


def model_dims(model: ModelSpec) -> dict[str, Any]:
    return entry_dims({name: getattr(model, name) for name in (*LAYER_DIMS, *OPTIONAL_LAYER_DIMS)})


def entry_dims(entry_model: dict) -> dict[str, Any]:
    """A layer shape as a profile entry holds it: the optional fields at their unset
    values left out."""
    dims = {name: entry_model.get(name) for name in LAYER_DIMS}
    dims.update({name: entry_model[name] for name, unset in OPTIONAL_LAYER_DIMS.items()
                 if entry_model.get(name, unset) != unset})
    return dims


def _dim(dims: dict[str, Any], name: str) -> Any:
    """A field of `entry_dims`, an optional one left out read as its unset value."""
    return dims.get(name, OPTIONAL_LAYER_DIMS.get(name))


def layer_key(entry: dict) -> tuple:
    """What identifies one layer measurement (`shardwise profile --extend` merges by it)."""
    return (entry["kind"], json.dumps(entry["model"], sort_keys=True), entry["seq_len"], entry["precision"],
            entry["attention"], entry["micro_batch_size"], entry["tp"])


@dataclass(frozen=True)
class LayerPoint:
    """One measured shape of one layer kind."""

    micro_batch_size: int
    tp: int
    forward_s: float
    backward_s: float


def _affine(x: float, x0: float, y0: float, x1: float, y1: float) -> float:
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


def _along_batch(points: list[tuple[int, float]], b: int) -> float | None:
    """Seconds at micro-batch size b from (b_i, seconds_i) at one TP width, sorted by b."""
    for bi, si in points:
        if bi == b:
            return si
    if len(points) < 2:
        return None
    if points[0][0] < b < points[-1][0]:
        upper = next(i for i, (bi, _) in enumerate(points) if bi > b)
        (b0, s0), (b1, s1) = points[upper - 1], points[upper]
        return _affine(b, b0, s0, b1, s1)
    if b < points[0][0]:
        (b0, s0), (b1, s1) = points[0], points[1]
        return min(s0, max(s0 * b / b0, _affine(b, b0, s0, b1, s1)))
    (b0, s0), (b1, s1) = points[-2], points[-1]
    return max(s1, min(s1 * b / b1, _affine(b, b0, s0, b1, s1)))


def interpolate(points: tuple[LayerPoint, ...], b: int, tp: int) -> tuple[float, float] | None:
    """(forward_s, backward_s) at micro-batch size b and TP width tp, or None where the
    points do not cover it (see the module docstring for the rule and its sources)."""
    widths = sorted({p.tp for p in points})

    def at_width(width: int) -> tuple[float, float] | None:
        row = sorted((p for p in points if p.tp == width), key=lambda p: p.micro_batch_size)
        fwd = _along_batch([(p.micro_batch_size, p.forward_s) for p in row], b)
        bwd = _along_batch([(p.micro_batch_size, p.backward_s) for p in row], b)
        return None if fwd is None or bwd is None else (fwd, bwd)

    if tp in widths:
        return at_width(tp)
    if not widths or not widths[0] < tp < widths[-1]:
        return None
    t1 = next(w for w in widths if w > tp)
    t0 = max(w for w in widths if w < tp)
    low, high = at_width(t0), at_width(t1)
    if low is None or high is None:
        return None
    return tuple(_affine(1 / tp, 1 / t0, lo, 1 / t1, hi) for lo, hi in zip(low, high))


@dataclass(frozen=True)
class MeasuredTimes:
    """The layer kinds of one model, at one sequence length, precision and attention
    kernel, as measured on `device_name`."""

    source: str
    device_name: str
    model_name: str
    seq_len: int
    precision: str
    attention: str
    points: dict[str, tuple[LayerPoint, ...]] = field(default_factory=dict)   # by layer kind

    def times(self, kind: str, micro_batch_size: int, tp: int) -> tuple[float, float] | None:
        """(forward_s, backward_s) of one layer kind, or None where not measured."""
        return interpolate(self.points.get(kind, ()), micro_batch_size, tp)

    def uncovered(self, micro_batch_size: int, tp: int) -> list[str]:
        """The layer kinds the analytic model prices at this shape."""
        return [k for k in LAYER_KINDS if self.times(k, micro_batch_size, tp) is None]

    def describe(self) -> str:
        shapes = sorted({(p.micro_batch_size, p.tp) for pts in self.points.values() for p in pts})
        mbs = ",".join(str(b) for b in sorted({b for b, _ in shapes}))
        tps = ",".join(str(t) for t in sorted({t for _, t in shapes}))
        return (f"measured {', '.join(k for k in LAYER_KINDS if k in self.points)} of {self.model_name} "
                f"(seq {self.seq_len}, {self.precision}, {self.attention} attention) on {self.device_name}, "
                f"micro-batch sizes {mbs}, tp {tps}")


def profiled_layer(profile: MeasuredTimes, model: ModelSpec, cluster: ClusterSpec, training: TrainingSpec,
                   micro_batch_size: int, tp: int, sequence_parallel: bool,
                   ep: int = 1) -> tuple[compute.LayerCompute, float] | None:
    """One layer's forward split as costmodel.terms.compute splits it and its backward seconds,
    from the measured times, or None where the profile does not cover the shape.

    The analytic split (GEMMs, attention core, elementwise) is scaled to the measured
    forward, since the estimate hides TP collectives behind the GEMM part and selective
    recompute repeats the attention core. The profile measures a TP shard without
    sequence parallelism; with it, the norms and residuals run on s/tp tokens, and the
    analytic model's difference for them is added (forward, and BACKWARD_FACTOR times it
    backward). An MoE layer is measured at ep 1: expert parallelism changes the shapes of
    the experts' GEMMs, not their work (costmodel.terms.compute.layer_compute)."""
    measured = profile.times("layer", micro_batch_size, tp)
    if measured is None:
        return None
    forward_s, backward_s = measured
    plain = compute.layer_compute(model, cluster, training, micro_batch_size, tp, False, ep)
    scale = forward_s / plain.forward_s if plain.forward_s > 0 else 1.0
    sp_delta = 0.0
    if sequence_parallel:
        sp_delta = compute.layer_compute(model, cluster, training, micro_batch_size, tp, True, ep).elementwise_s \
            - plain.elementwise_s
    layer = compute.LayerCompute(plain.gemm_s * scale, plain.attention_core_s * scale,
                                 plain.elementwise_s * scale + sp_delta)
    return layer, backward_s + compute.BACKWARD_FACTOR * sp_delta


# --- reading and validating ---------------------------------------------------------

def _int(value: Any, where: str, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise SpecError(where, f"expected an integer of at least {minimum}, got {value!r}")
    return value


def _seconds(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise SpecError(where, f"expected a positive number of seconds, got {value!r}")
    return float(value)


def _choice(value: Any, where: str, known: tuple[str, ...]) -> str:
    if value not in known:
        raise SpecError(where, f"expected one of {', '.join(known)}, got {value!r}")
    return value


def validate_layer_entry(entry: Any, where: str) -> dict:
    """One entry of a profile's "layers", checked; raises SpecError naming the field."""
    if not isinstance(entry, dict):
        raise SpecError(where, "expected a mapping")
    for key in ("kind", "model", "model_name", "seq_len", "precision", "attention", "micro_batch_size", "tp",
                "forward_s", "backward_s"):
        if key not in entry:
            raise SpecError(f"{where}.{key}", "missing")
    _choice(entry["kind"], f"{where}.kind", LAYER_KINDS)
    _choice(entry["precision"], f"{where}.precision", PRECISIONS)
    _choice(entry["attention"], f"{where}.attention", ATTENTION_KINDS)
    if not isinstance(entry["model"], dict):
        raise SpecError(f"{where}.model", "expected a mapping of model dimensions")
    for name in LAYER_DIMS:
        if name not in entry["model"]:
            raise SpecError(f"{where}.model.{name}", "missing")
        if name != "model_type":
            _int(entry["model"][name], f"{where}.model.{name}")
    for name, unset in OPTIONAL_LAYER_DIMS.items():
        if name not in entry["model"]:
            continue
        value = entry["model"][name]
        if isinstance(unset, bool):
            if not isinstance(value, bool):
                raise SpecError(f"{where}.model.{name}", "expected true or false")
        elif isinstance(unset, str):
            if not isinstance(value, str):
                raise SpecError(f"{where}.model.{name}", f"expected a name, got {value!r}")
        elif name == "swiglu_limit":
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise SpecError(f"{where}.model.{name}", f"expected a number, got {value!r}")
        else:
            _int(value, f"{where}.model.{name}")
    for key in ("seq_len", "micro_batch_size", "tp"):
        _int(entry[key], f"{where}.{key}")
    for key in ("forward_s", "backward_s"):
        _seconds(entry[key], f"{where}.{key}")
    return entry


def check_mergeable(doc: dict, where: str = "profile") -> None:
    """What `executor.measure.extend` reads of an old profile: lists of GEMM points (m, n,
    k), elementwise points (bytes), collectives by kind (bytes) and layer entries.
    Raises SpecError naming the first field that is not so."""
    for name, keys in (("gemm", ("m", "n", "k")), ("elementwise", ("bytes",))):
        points = doc.get(name)
        if not isinstance(points, list) or not all(isinstance(p, dict) and all(k in p for k in keys) for p in points):
            raise SpecError(f"{where}.{name}", f"expected a list of measurements, each with {', '.join(keys)}")
    collectives = doc.get("collectives")
    if not isinstance(collectives, dict):
        raise SpecError(f"{where}.collectives", "expected a mapping of collective kind to measurements")
    for kind, points in collectives.items():
        if not isinstance(points, list) or not all(isinstance(p, dict) and "bytes" in p for p in points):
            raise SpecError(f"{where}.collectives.{kind}", "expected a list of measurements, each with bytes")
    check_layers(doc, where)


def check_layers(doc: dict, where: str = "profile") -> None:
    """A profile's layer entries (absent in version 1), each as validate_layer_entry wants."""
    layers = doc.get("layers", [])
    if not isinstance(layers, list):
        raise SpecError(f"{where}.layers", "expected a list of measurements")
    for i, entry in enumerate(layers):
        validate_layer_entry(entry, f"{where}.layers[{i}]")


def read_profile(path: str | Path) -> dict:
    """A profile's JSON, checked as far as planning needs it; raises SpecError."""
    doc = read_json_object(path, "--profile")
    if doc.get("schema_version") not in READABLE_SCHEMA_VERSIONS:
        raise SpecError("profile.schema_version",
                        f"expected one of {', '.join(map(str, READABLE_SCHEMA_VERSIONS))}, got {doc.get('schema_version')!r}")
    check_layers(doc)
    return doc


def measured_times(doc: dict, model: ModelSpec, training: TrainingSpec, source: str = "profile") -> MeasuredTimes:
    """The measurements of `doc` that apply to this model, sequence length, precision and
    attention kernel; a profile of something else raises SpecError naming the field
    that differs (a plan must not silently price another model's layers)."""
    entries = doc.get("layers", [])
    if not entries:
        raise SpecError("profile.layers", "the profile has no layer measurements (take one with shardwise profile --model)")
    dims = model_dims(model)
    mine = [e for e in entries if entry_dims(e["model"]) == dims]
    if not mine:
        other = entry_dims(entries[0]["model"])
        name = next(n for n in (*LAYER_DIMS, *OPTIONAL_LAYER_DIMS) if _dim(other, n) != _dim(dims, n))
        raise SpecError(f"profile.model.{name}", f"the profile measured {entries[0]['model_name']} with "
                                                 f"{_dim(other, name)!r}, the model has {_dim(dims, name)!r}")
    attention = "flash" if training.flash_attention else "eager"
    for key, wanted in (("precision", training.precision), ("seq_len", training.seq_len), ("attention", attention)):
        matching = [e for e in mine if e[key] == wanted]
        if not matching:
            have = ", ".join(sorted({str(e[key]) for e in mine}))
            raise SpecError(f"profile.{key}", f"the profile measured {have}, the plan uses {wanted}")
        mine = matching
    points: dict[str, list[LayerPoint]] = {}
    for e in sorted(mine, key=layer_key):
        points.setdefault(e["kind"], []).append(LayerPoint(e["micro_batch_size"], e["tp"], float(e["forward_s"]),
                                                           float(e["backward_s"])))
    return MeasuredTimes(source=source, device_name=str(doc.get("device_name", doc.get("device", "?"))),
                         model_name=str(mine[0]["model_name"]), seq_len=training.seq_len,
                         precision=training.precision, attention=attention,
                         points={k: tuple(v) for k, v in sorted(points.items())})


def load_measured_times(path: str | Path, model: ModelSpec, training: TrainingSpec) -> MeasuredTimes:
    return measured_times(read_profile(path), model, training, str(path))
