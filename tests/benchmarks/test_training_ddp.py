"""benchmarks/training_ddp.py on a CPU (--smoke: two processes over gloo, a tiny network, the operator
falling back to torch): every variant trains under DistributedDataParallel and again in one process
over the same global batches, and the two agree step by step; what it writes has the issue's fields."""
import json
import socket
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import training_ddp  # noqa: E402


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_smoke_run_trains_each_variant_on_two_processes_and_one(tmp_path):
    training_ddp.main(["--smoke", "--batch-per-gpu", "4", "--steps", "3", "--warmup", "1", "--variants", "eager",
                       "ours", "--compile-ahead", "--port", str(free_port()), "--outdir", str(tmp_path)])
    data = json.loads((tmp_path / "training_ddp.json").read_text())
    assert {"device", "gpus", "torch", "triton", "rows"} <= data.keys() and data["gpus"] == 2
    assert [(r["variant"], r["gpus"]) for r in data["rows"]] == [("eager", 2), ("eager", 1), ("ours", 2), ("ours", 1)]
    for row in data["rows"]:
        assert {"net", "batch_per_gpu", "gpus", "variant", "img_s", "scaling", "loss_50"} <= row.keys()
        assert row["img_s"] > 0 and len(row["losses"]) == 3 and row["loss_50"] is None
        # the same arithmetic in another order (fp32 sums): far inside the bf16 tolerance
        assert row["loss_gap"] < 1e-5 < row["loss_tolerance"]
    assert [row["scaling"] for row in data["rows"] if row["gpus"] == 1] == [1.0, 1.0]
