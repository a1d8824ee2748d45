"""What ``data.check`` costs before launch: ``check_files`` on a JSONL file and the same records as Parquet, GSM8K-like
records (a question of ~250 characters, a solution of ~300, a nested field), with 'full', 'first:1000' and 'off',
side by side in one run; medians, scaled to a million records.

    python benchmarks/data_check.py                 # 200k records, ~1 minute here
    python benchmarks/data_check.py --records 1000000
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import tempfile
import time

from megarl.data import check_files


def _records(n: int, seed: int = 0):
    rng = random.Random(seed)
    words = "the of a number she has apples pears buys sells each day how many total left".split()
    for i in range(n):
        question = " ".join(rng.choice(words) for _ in range(45))
        answer = rng.randint(0, 10_000)
        solution = " ".join(rng.choice(words) for _ in range(55)) + f" #### {answer}"
        yield {"prompt": [{"role": "user", "content": question}], "reward_model": {"ground_truth": str(answer)},
               "extra_info": {"index": i, "solution": solution}}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=200_000)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        jsonl = os.path.join(tmp, "train.jsonl")
        with open(jsonl, "w") as f:
            for r in _records(args.records):
                f.write(json.dumps(r) + "\n")
        files = {"jsonl": jsonl}
        try:
            import pyarrow as pa
            import pyarrow.parquet as pq

            files["parquet"] = os.path.join(tmp, "train.parquet")
            pq.write_table(pa.Table.from_pylist(list(_records(args.records))), files["parquet"])
        except ImportError:
            pass
        size = os.path.getsize(jsonl) / 1e6
        print(f"{args.records} records ({size:.0f} MB of JSONL); seconds per million records, median of "
              f"{args.repeats}:")  # fmt: skip
        for fmt, path in files.items():
            row = []
            for check in ("full", "first:1000", "off"):
                times = []
                for _ in range(args.repeats):
                    t = time.perf_counter()
                    check_files([path], "prompt", "reward_model.ground_truth", check=check)
                    times.append(time.perf_counter() - t)
                row.append(f"{check} {statistics.median(times) * 1e6 / args.records:7.2f} s")
            print(f"  {fmt:8s} " + "   ".join(row))


if __name__ == "__main__":
    main()
