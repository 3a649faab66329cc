"""The README's Python section runs as written: its planning script in this process,
its training script under torchrun on two gloo ranks (first loss equal to the
unparallelized model's)."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).parents[1] / "README.md"


def script(name: str) -> str:
    """The fenced python block of the README whose first line is `# name`."""
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    found = [b for b in blocks if b.startswith(f"# {name}\n")]
    assert len(found) == 1, f"README holds {len(found)} blocks named {name}"
    return found[0]


def test_the_planning_script_runs_and_plans_a_dag_module(capsys):
    namespace = {"__name__": "readme"}
    exec(compile(script("plan_example.py"), "plan_example.py", "exec"), namespace)
    stages = namespace["doc"]["strategy"]["stages"]
    # stem, left (conv, relu), right (conv, relu), head: six blocks over two stages.
    assert [s["pp_rank"] for s in stages] == [0, 1] and sum(s["num_layers"] for s in stages) == 6
    out = capsys.readouterr().out
    assert out.startswith("llama3-70b: ") and f"stages: {[(s['first_layer'], s['num_layers']) for s in stages]}" in out


def test_the_training_script_runs_under_torchrun(tmp_path):
    pytest.importorskip("transformers")
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    path = tmp_path / "train_example.py"
    path.write_text(script("train_example.py"))
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                             str(path)], capture_output=True, text=True, timeout=240, cwd=README.parent)
    assert result.returncode == 0, result.stderr[-3000:]
    losses = [float(v) for v in re.findall(r"step \d: loss ([0-9.]+)", result.stdout)]
    assert len(losses) == 3
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = AutoModelForCausalLM.from_config(config)
    ids = torch.randint(0, 256, (8, 64), generator=torch.Generator().manual_seed(0))
    assert losses[0] == pytest.approx(model(input_ids=ids, labels=ids).loss.item(), abs=1e-4)
