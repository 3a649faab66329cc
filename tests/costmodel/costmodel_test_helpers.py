"""Shared helpers for the tests/costmodel suite (a uniquely named module rather than a
conftest, so it cannot clash with helpers in other test folders).

The hand formulas here are written out from their sources (Thakur et al. 2005 ring
collectives, the NVIDIA GEMM efficiency model the code documents) and deliberately do
not call the code under test, so tests compare the code against independent arithmetic.
"""

from __future__ import annotations

import json
from pathlib import Path

from costmodel.estimate import estimate
from costmodel.estimate.uniform import unit_costs
from costmodel.problem import Problem
from costmodel.specs import RuntimeSpec
from costmodel.specs.loading import (
    load_cluster,
    load_model,
    load_runtime,
    make_training,
)
from costmodel.strategy import Strategy, even_stages

REPO = Path(__file__).resolve().parents[2]
HF_DIR = REPO / "tests" / "data" / "hf"
REFERENCE_DIR = Path(__file__).resolve().parents[2].parent / "shared" / "reference"
CALIBRATION_FILE = REFERENCE_DIR / "calibration_runs.json"

# dgx-a100-80gb.yaml / a100-80gb.yaml figures, copied by hand from the YAML files.
A100_PEAK_BF16 = 3.12e14
A100_HBM = 2.039e12
NVLINK_BW = 3.0e11 * 0.62       # achieved = bandwidth * efficiency
NVLINK_LAT = 5.0e-6
IB_BW = 2.5e10 * 0.8
IB_LAT = 1.0e-5


def load_calibration_runs() -> list[dict]:
    return json.loads(CALIBRATION_FILE.read_text())


# The terms' hand computations in these tests are of the analytic formulas alone: a
# runtime with no engine effects (every overlap 1, no message-size penalty, kernels at
# the hardware curve, no fixed cost: RuntimeSpec's defaults). The runtime profiles'
# own terms are checked by hand in tests/costmodel/specs/test_runtime.py.
NEUTRAL = RuntimeSpec(name="neutral", version=1)


def problem(model="tiny-gpt", cluster="dgx-a100-80gb", global_batch=8, seq_len=None, gpus=None,
            nodes=None, flash_attention=True, precision="bf16", optimizer="adamw", overrides=None,
            mixed_precision="megatron", runtime: RuntimeSpec | str = NEUTRAL) -> Problem:
    """The estimate tests' by-hand figures are Korthikanti et al.'s and ZeRO's, Megatron-LM's
    recipe (mixed_precision "megatron"); PyTorch's own 16-bit accounting ("autocast",
    "param_dtype") is tested in tests/costmodel/terms/test_memory.py and against the
    trackers."""
    mm = load_model(model, overrides=overrides) if isinstance(model, str) else model
    cc = load_cluster(cluster, nodes=nodes, gpus=gpus) if isinstance(cluster, str) else cluster
    tt = make_training(mm, cc, global_batch, seq_len, precision=precision, optimizer=optimizer,
                       flash_attention=flash_attention, mixed_precision=mixed_precision)
    return Problem(mm, cc, tt, runtime=load_runtime(runtime) if isinstance(runtime, str) else runtime)


def strategy(prob: Problem, dp=1, tp=1, pp=1, micro_batch_size=1, num_microbatches=None, vpp=1,
             recompute="none", **kw) -> Strategy:
    """A strategy with even stages; num_microbatches defaults to global_batch/(dp*mbs)."""
    if num_microbatches is None:
        num_microbatches = prob.training.global_batch // (dp * micro_batch_size)
    if "schedule" not in kw:
        kw["schedule"] = "interleaved" if vpp > 1 else "1f1b"
    s = Strategy(dp=dp, tp=tp, pp=pp, micro_batch_size=micro_batch_size,
                 num_microbatches=num_microbatches, vpp=vpp, **kw)
    return s.with_stages(even_stages(prob.model.num_hidden_layers, pp, vpp, recompute, s.schedule))


def run(prob: Problem, **kw):
    s = strategy(prob, **kw)
    return estimate(prob, s), unit_costs(prob, s), s


# ---------------------------------------------------------------- hand formulas
def ring_all_reduce(total_bytes, n, bw, lat):
    """Thakur et al. 2005: reduce-scatter + all-gather, 2(n-1)/n of the buffer."""
    return 2 * (n - 1) / n * total_bytes / bw + 2 * (n - 1) * lat


def ring_gather(total_bytes, n, bw, lat):
    """All-gather or reduce-scatter: (n-1)/n of the buffer."""
    return (n - 1) / n * total_bytes / bw + (n - 1) * lat


def gemm_seconds(m, n, k, peak, batch=1.0):
    """2mnk FLOPs at 0.84 * prod(d / (d + 128)) of peak (costmodel.terms.compute's documented model)."""
    eff = 0.84 * (m / (m + 128)) * (n / (n + 128)) * (k / (k + 128))
    return 2.0 * m * n * k * batch / (peak * eff)


def hbm_seconds(num_bytes, hbm=A100_HBM):
    """Memory-bound kernels at 80% of HBM bandwidth."""
    return num_bytes / (hbm * 0.8)
