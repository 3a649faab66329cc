"""Fidelity: the eight measured runs of Korthikanti et al. 2022 (Tables 3 and 5, in
../shared/reference/calibration_runs.json), each planned with its configuration pinned
through --fix (the same path as the CLI), predicted against measured iteration time.
Prints a table and writes bench/results/fidelity.json."""

import json
import statistics
import sys
from pathlib import Path

from planner.api import plan

NAMES = {"22B": "gpt-22b", "175B (GPT-3)": "gpt3-175b", "530B (MT-NLG)": "gpt-530b", "1T": "gpt-1t"}


def main() -> None:
    ref = Path(__file__).resolve().parents[2] / "shared" / "reference" / "calibration_runs.json"
    if not ref.exists():
        sys.exit(f"reference runs not found at {ref}")
    rows = []
    for run in json.loads(ref.read_text()):
        chunks = run["interleaved_pipeline"].get("model_chunks_per_rank", 1) if run["interleaved_pipeline"]["used"] else 1
        fix = {"dp": 1, "tp": run["tp"], "pp": run["pp"], "mbs": run["micro_batch"], "vpp": chunks,
               "recompute": run["activation_recompute"], "sp": run["sequence_parallel"], "zero": 0}
        if run["pp"] > 1:
            fix["schedule"] = "interleaved" if chunks > 1 else "1f1b"
        doc = plan(NAMES[run["model"]["name"]], "dgx-a100-80gb", run["global_batch"], gpus=run["gpus"],
                   seq_len=run["seq_len"], flash_attention=False, fix=fix, top=1,
                   rules=None, runtime="megatron")   # Megatron-LM ran these (configs/runtimes/megatron.yaml)
        predicted, measured = doc["estimate"]["step_time_s"], run["measured"]["iteration_time_s"]
        rows.append({"id": run["id"], "predicted_s": predicted, "measured_s": measured,
                     "error": predicted / measured - 1, "peak_memory_gib": doc["estimate"]["peak_memory_bytes"] / 2**30})
        r = rows[-1]
        print(f"{r['id']:40s} predicted {predicted:7.2f} s  measured {measured:7.2f} s  "
              f"error {100 * r['error']:+5.1f}%  peak {r['peak_memory_gib']:.1f} GiB")
    errors = [abs(r["error"]) for r in rows]
    print(f"max |error| {100 * max(errors):.1f}%, median |error| {100 * statistics.median(errors):.1f}%")
    Path(__file__).with_name("results").mkdir(exist_ok=True)
    (Path(__file__).parent / "results" / "fidelity.json").write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
