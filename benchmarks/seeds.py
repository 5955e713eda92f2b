"""Several seeds of benchmarks/train.py in one table: each method's final validation loss
against the run's first method (the baseline, e.g. allreduce or fsdp) seed by seed, their
mean and standard deviation, and the payload bytes per step.

    python benchmarks/seeds.py docs/convergence/hadamard/gpt*.json

Every file is one train.py run (one task, one seed); a method is compared only with the
baseline of its own run, so runs of different method lists can be combined. A method
missing from some seeds shows a blank there and averages the seeds it has.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict


def relative_losses(paths):
    """{task: {method: {seed: (relative loss, bytes per step, float32 bytes per step)}}}"""
    table = defaultdict(lambda: defaultdict(dict))
    for path in paths:
        with open(path) as f:
            run = json.load(f)
        base = run["results"][0]["val_loss"]
        for r in run["results"]:
            table[run["task"]][r["method"]][run["seed"]] = (
                r["val_loss"] / base - 1, r["bytes_per_step"], r["float32_bytes_per_step"])
    return table


def markdown(task, methods) -> str:
    seeds = sorted({s for per_seed in methods.values() for s in per_seed})
    lines = [f"{task}: validation loss against the baseline of each run",
             "| method | " + " | ".join(f"seed {s}" for s in seeds) +
             " | mean | std | payload bytes/step/rank | x fewer |",
             "|---|" + "---:|" * (len(seeds) + 4)]
    for method, per_seed in methods.items():
        rel = [per_seed[s][0] for s in seeds if s in per_seed]
        cells = [f"{per_seed[s][0]:+.2%}" if s in per_seed else "" for s in seeds]
        std = f"{statistics.stdev(rel):.2%}" if len(rel) > 1 else ""
        _, sent, float32 = next(iter(per_seed.values()))
        lines.append(f"| {method} | " + " | ".join(cells) +
                     f" | {statistics.mean(rel):+.2%} | {std} | {sent:,.0f} | {float32 / sent:.2f} |")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", help="train.py result files (<task>[-seedN].json)")
    args = parser.parse_args()
    for task, methods in relative_losses(args.runs).items():
        print(markdown(task, methods) + "\n")


if __name__ == "__main__":
    main()
