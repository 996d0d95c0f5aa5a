"""The pre-flight's non-finite weight check (remote.drafters.checkpoint.nonfinite_tensors) on a
drafter-sized safetensors file, against reading the same file once (sha256, as `--verify-hashes`
does) in the same run: ``python benchmarks/bench_nonfinite.py [--gib 4] [--dir DIR]``.

The file is bf16 (how drafters are saved), ``--gib`` GiB of 256 MiB tensors of finite values, one
NaN in its last tensor's last element (the check reads everything before it finds it); written once
and removed after. Each measure is taken twice, the file in the page cache (the second read of a
checkpoint a sync just wrote or a pre-flight just read)."""
from __future__ import annotations

import argparse
import hashlib
import json
import struct
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

TENSOR = 256 << 20
ONE_BF16 = b"\x80\x3f"          # 1.0
NAN_BF16 = b"\xc0\x7f"


def write(path: Path, gib: int) -> list[str]:
    n = gib * (1 << 30) // TENSOR
    rows = TENSOR // 2 // 4096
    names = [f"layers.{i}.mlp.up_proj.weight" for i in range(n)]
    header = {name: {"dtype": "BF16", "shape": [rows, 4096], "data_offsets": [i * TENSOR, (i + 1) * TENSOR]}
              for i, name in enumerate(names)}
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    block = ONE_BF16 * (TENSOR // 2)
    with open(path, "wb") as fh:
        fh.write(struct.pack("<Q", len(raw)) + raw)
        for i in range(n):
            fh.write(block if i < n - 1 else block[:-2] + NAN_BF16)
    return names


def main() -> None:
    from remote.drafters.checkpoint import nonfinite_tensors
    from remote.drafters.config import DrafterConfig

    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--gib", type=int, default=4)
    p.add_argument("--dir", default=None, help="where to write the file (default: a temporary folder)")
    args = p.parse_args()
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        path = Path(tmp) / "model.safetensors"
        names = write(path, args.gib)
        cfg = DrafterConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=16, target_layer_ids=[0], mask_token_id=0, vocab_size=8)
        ckpt = SimpleNamespace(weight_files=[path], config=cfg)
        size = path.stat().st_size
        for rep in range(2):
            t0 = time.perf_counter()
            found = nonfinite_tensors(ckpt, names)
            check = time.perf_counter() - t0
            assert found == [names[-1]], found
            t0 = time.perf_counter()
            digest = hashlib.sha256()
            with open(path, "rb") as fh:
                while chunk := fh.read(8 << 20):
                    digest.update(chunk)
            hashed = time.perf_counter() - t0
            print(f"rep {rep + 1}: {size / 2**30:.1f} GiB: non-finite check {check:.2f} s "
                  f"({size / check / 2**30:.2f} GiB/s), sha256 {hashed:.2f} s ({size / hashed / 2**30:.2f} GiB/s), "
                  f"ratio {check / hashed:.2f}x")


if __name__ == "__main__":
    main()
