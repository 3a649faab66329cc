"""FP8 training against measured runs that no fit saw: torchtitan's float8 Llama 3.1 rows
on H100 (../shared/reference/torchtitan_h100_runs.json: FSDP2 on 8 and 128 GPUs, FSDP2 +
TP8 on 64 and 256, tensorwise and rowwise, compiled), priced by the committed
pytorch-native runtime profile, whose coefficients were fitted on the bf16 rows only
(bench/calibrate_runtime.py). Beside each float8 row, its bf16 twin (the same strategy):
the predicted FP8 speed-up against the measured one.

    PYTHONPATH=. python bench/fp8.py
Writes bench/results/fp8.{json,txt}.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from calibrate_runtime import Fit, predict, torchtitan_rows

from costmodel.specs.loading import load_runtime

REPO = Path(__file__).resolve().parents[1]


def twin_id(run_id: str) -> str:
    """The bf16 row of the same strategy: tt_8b_8gpu_fsdp_compile_float8 -> ..._compile,
    tt_70b_256gpu_tp8_float8_rowwise_asynctp -> tt_70b_256gpu_tp8_bf16_asynctp."""
    for recipe in ("_float8_tensorwise", "_float8_rowwise"):
        if recipe in run_id:
            return run_id.replace(recipe, "_bf16")
    return run_id.removesuffix("_float8")


def main() -> None:
    state = Fit(load_runtime("pytorch-native"))
    bf16 = {row.id: row for row in torchtitan_rows()[0]}
    out, lines = [], []
    for row in torchtitan_rows(float8=True)[0]:
        predicted_s = predict(row, state)[0]
        entry = {"id": row.id, "fp8": row.problem.training.fp8, "measured_step_s": row.measured_step_s,
                 "predicted_step_s": predicted_s, "error": predicted_s / row.measured_step_s - 1}
        twin = bf16.get(twin_id(row.id))
        if twin is not None:
            entry["measured_speedup"] = twin.measured_step_s / row.measured_step_s
            entry["predicted_speedup"] = predict(twin, state)[0] / predicted_s
        out.append(entry)
        speedup = (f"  speed-up over bf16: predicted {entry['predicted_speedup']:.2f}x, measured "
                   f"{entry['measured_speedup']:.2f}x" if twin is not None else "")
        lines.append(f"{row.id:45s} {entry['fp8']:10s} step {predicted_s:7.3f} s predicted, "
                     f"{row.measured_step_s:7.3f} s measured ({entry['error']:+.1%}){speedup}")
    errors = [abs(e["error"]) for e in out]
    lines.append(f"{len(out)} held-out float8 rows: median |error| {statistics.median(errors):.1%}, "
                 f"max {max(errors):.1%}")
    text = "\n".join(lines)
    print(text)
    results = REPO / "bench" / "results"
    results.mkdir(exist_ok=True)
    (results / "fp8.txt").write_text(text + "\n")
    (results / "fp8.json").write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
