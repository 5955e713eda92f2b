"""Convergence of DDP training with cgx against the alternatives, side by side.

Trains the same model with the same seeds and steps on N local ranks ("cgx" backend
underneath, uncompressed unless a method compresses), once per method:

  allreduce     DDP's default allreduce (float32, exact)
  fp16          torch's fp16_compress_hook
  powersgd      torch's PowerSGD hook (rank 4, error feedback)
  cgxB[-bucket128][-hadamard][-one-level | -no-feedback]
                cgx_hook at B = 2, 3, 4 or 8 bits, buckets of 512 (or 128) values, the
                maxmin scheme (or hadamard), two-level error feedback (or one-level: each
                rank's own quantization only; or none); e.g. cgx4, cgx2-hadamard
  cgx-adaptive[-hadamard][-alphaA][-feedback-by-bits | -no-feedback]
                cgx_hook with L-GreCo bit selection (maxmin at 2..8 bits, buckets 128 or
                512: MAXMIN_CANDIDATES; budget 3x (or A x) uniform 4-bit maxmin's normalized
                error); -hadamard: cgx.AdaptiveBits' defaults, both schemes; two-level
                error feedback on every layer (or CGXState's default, two-level only on
                layers at 2 bits or fewer; or none)
  fsdp          FSDP2 (fully_shard per block and on the root), exact
  qsdp-wAgB[-nearest][-hadamard][-feedback][-bucketN]
                FSDP2 with cgx.qsdp: weights gathered at A bits (stochastic rounding, or
                rounded to nearest), gradients reduce-scattered at B bits; the maxmin
                scheme (or hadamard where it fits); without error feedback (or with it);
                buckets of 512 values (-bucketN: of N, for both)
  diloco-hH-pP-bB-oK  cgx.DiLoCo, no DDP: every rank a replica, syncing every H steps in P
                fragments (strided; -seq: sequential), outer gradients at B bits in maxmin
                with error feedback (-hadamard: in that scheme; -topNofC: sparse, the N
                largest of each chunk of C values sent; -sharedNofC: N places of each chunk
                drawn at random, alike on every replica; -dB: the residual decayed by B,
                SparseLoCo's beta), applied K steps later; outer Nesterov SGD lr 0.7,
                momentum 0.9, mix 0.5 unless -lrA / -mB (0: plain SGD) / -xC say otherwise; evaluated on
                rank 0's own weights

Tasks:
  gpt     a small GPT-style transformer on real text: CPython's own standard-library
          sources (bytes as tokens); reports validation loss.
  digits  an MLP classifier on scikit-learn's bundled digits images; reports accuracy.
  shapes  a small convolutional net on synthetic noisy 16x16 images; reports accuracy.
  charrnn a one-layer GRU over the gpt task's bytes (recurrent, gated); validation loss.

    python benchmarks/train.py --task gpt --steps 300 --world-size 2
    python benchmarks/train.py --task digits --out docs/convergence
    python benchmarks/train.py --task gpt --gpt-dim 288 --lr 1e-3   # AdamW lr other than the task's
    python benchmarks/train.py --task gpt --link 1gbit --steps 60 --gpt-dim 256   # root

Prints a table (final loss / accuracy, payload bytes per step per rank, ratio to
float32, seconds) and writes <out>/<task>.json and <out>/<task>.png (loss curves);
<out> is benchmarks/results/convergence (git-ignored) unless --out says otherwise.
With --link RATE every rank runs on its own emulated host (benchmarks/netemu.py) behind
a link of that rate, and the table adds steps per second and the bytes that crossed the
links per step.
"""

from __future__ import annotations

import argparse
import datetime
import inspect
import json
import os
import re
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # python -P: the helpers here

from outputs import default_output  # noqa: E402
from plotting import pyplot  # noqa: E402

# cgx<bits>[-bucket<size>][-hadamard][-one-level | -no-feedback]: the cgx hook with that
# uniform setting; two-level error feedback unless the name says otherwise.
CGX_METHODS = tuple(f"cgx{b}{k}{s}{f}" for b in (2, 3, 4, 8) for k in ("", "-bucket128") for s in ("", "-hadamard")
                    for f in ("", "-one-level", "-no-feedback"))
ADAPTIVE_METHODS = tuple(f"cgx-adaptive{s}{a}{f}" for s in ("", "-hadamard") for a in ("", "-alpha4", "-alpha5", "-alpha6")
                         for f in ("", "-feedback-by-bits", "-no-feedback"))
DDP_METHODS = ("allreduce", "fp16", "powersgd") + CGX_METHODS + ADAPTIVE_METHODS
FSDP_METHODS = ("fsdp",) + tuple(f"qsdp-w{w}g{g}{r}{s}{f}" for w in (8, 4, 2) for g in (8, 4, 2)
                                  for r in ("", "-nearest") for s in ("", "-hadamard") for f in ("", "-feedback")) + tuple(
                                      f"qsdp-w4g4-nearest{s}-bucket{b}" for s in ("", "-hadamard") for b in (64, 128, 256))
# diloco-hH-pP-bB-oK and its variants, in this order (see the docstring)
DILOCO_METHOD = re.compile(r"diloco-h\d+-p\d+-b(2|3|4|8|32)-o\d+(-seq)?(-hadamard)?(-(top|shared)\d+of\d+)?"
                           r"(-lr[\d.]+)?(-m[\d.]+)?(-x[\d.]+)?(-d[\d.]+)?")


def is_diloco(method):
    return DILOCO_METHOD.fullmatch(method) is not None


def method_name(text):
    """argparse's check of a --methods entry."""
    if text in DDP_METHODS or text in FSDP_METHODS or is_diloco(text):
        return text
    raise argparse.ArgumentTypeError(f"unknown method {text!r} (see --help)")


WARMUP_STEPS = 10  # uncompressed first steps, for every compressing method alike
# Adaptive over maxmin alone: cgx.AdaptiveBits' candidates before cgx 0.2 (its defaults
# since are both schemes', what cgx-adaptive-hadamard measured).
MAXMIN_CANDIDATES = ((2, 128), (2, 512), (3, 128), (3, 512), (4, 512), (6, 512), (8, 512))


# ---- tasks: data and model


def stdlib_text() -> bytes:
    """Real text every machine has: the sources of a few CPython standard modules."""
    import argparse as m1, collections as m2, inspect as m3, os as m4, typing as m5
    import unittest.case as m6

    return "\n".join(inspect.getsource(m) for m in (m1, m2, m3, m4, m5, m6)).encode()


class GPT(torch.nn.Module):
    """Decoder-only transformer over bytes (pre-norm blocks, learned positions)."""

    def __init__(self, dim=128, depth=2, heads=4, context=64, vocab=256):
        super().__init__()
        self.tokens = torch.nn.Embedding(vocab, dim)
        self.positions = torch.nn.Parameter(torch.zeros(context, dim))
        layer = torch.nn.TransformerEncoderLayer(
            dim, heads, 4 * dim, dropout=0.0, batch_first=True, norm_first=True
        )
        self.blocks = torch.nn.TransformerEncoder(layer, depth, enable_nested_tensor=False)
        self.norm = torch.nn.LayerNorm(dim)
        self.out = torch.nn.Linear(dim, vocab)
        self.register_buffer("causal", torch.nn.Transformer.generate_square_subsequent_mask(context))

    def forward(self, x):
        h = self.tokens(x) + self.positions[: x.shape[1]]
        return self.out(self.norm(self.blocks(h, mask=self.causal, is_causal=True)))


class GPTTask:
    name = "gpt"
    context = 64
    lr = 3e-3

    def __init__(self, dim=128, batch=16, depth=2):
        self.dim = dim
        self.depth = depth
        self.batch = batch
        data = torch.tensor(list(stdlib_text()), dtype=torch.long)
        split = int(0.9 * data.numel())
        self.train, self.val = data[:split], data[split:]

    def model(self):
        return GPT(dim=self.dim, depth=self.depth, context=self.context)

    def batch_for(self, rank, step, seed=0, source=None):
        source = self.train if source is None else source
        g = torch.Generator().manual_seed(10_000 * step + rank + 10**9 * seed)
        starts = torch.randint(0, source.numel() - self.context - 1, (self.batch,), generator=g)
        x = torch.stack([source[s : s + self.context] for s in starts])
        y = torch.stack([source[s + 1 : s + self.context + 1] for s in starts])
        return x, y

    def loss(self, model, x, y):
        return torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())

    @torch.no_grad()
    def evaluate(self, model):
        losses = [self.loss(model, *self.batch_for(0, 10**6 + i, source=self.val)).item() for i in range(20)]
        return {"val_loss": sum(losses) / len(losses)}


class Classification:
    """Cross-entropy on labelled examples; validation on the held-out (x, y) in self.val."""

    def loss(self, model, x, y):
        return torch.nn.functional.cross_entropy(model(x), y)

    @torch.no_grad()
    def evaluate(self, model):
        x, y = self.val
        logits = model(x)
        return {"val_loss": torch.nn.functional.cross_entropy(logits, y).item(),
                "val_accuracy": (logits.argmax(1) == y).float().mean().item()}


class DigitsTask(Classification):
    name = "digits"
    batch = 32
    lr = 1e-3

    def __init__(self):
        from sklearn.datasets import load_digits

        x, y = load_digits(return_X_y=True)
        x = torch.tensor(x, dtype=torch.float32) / 16.0
        y = torch.tensor(y)
        order = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))
        x, y = x[order], y[order]
        self.train, self.val = (x[:1400], y[:1400]), (x[1400:], y[1400:])

    def model(self):
        return torch.nn.Sequential(
            torch.nn.Linear(64, 512), torch.nn.ReLU(), torch.nn.Linear(512, 512), torch.nn.ReLU(),
            torch.nn.Linear(512, 10),
        )

    def batch_for(self, rank, step, seed=0):
        g = torch.Generator().manual_seed(10_000 * step + rank + 10**9 * seed)
        idx = torch.randint(0, len(self.train[1]), (self.batch,), generator=g)
        return self.train[0][idx], self.train[1][idx]



class ShapesTask(Classification):
    """A small convolutional net on synthetic 16x16 colour images: ten classes, each a fixed
    random smooth pattern, seen shifted by up to 3 pixels, at a random contrast, under
    strong noise (so the loss settles well above zero). Nothing to download."""

    name = "shapes"
    batch = 32
    lr = 2e-3
    size = 16

    def __init__(self):
        g = torch.Generator().manual_seed(1234)
        coarse = torch.randn(10, 3, 4, 4, generator=g)
        self.templates = torch.nn.functional.interpolate(coarse, size=(self.size, self.size), mode="bilinear",
                                                         align_corners=False)
        self.templates /= self.templates.flatten(1).std(1).view(10, 1, 1, 1)
        self.val = self.images(torch.Generator().manual_seed(999), 1000)

    def images(self, g, count):
        labels = torch.randint(0, 10, (count,), generator=g)
        shifts = torch.randint(-3, 4, (count, 2), generator=g)
        contrast = 0.3 + 0.7 * torch.rand(count, 1, 1, 1, generator=g)
        x = torch.stack([torch.roll(self.templates[c], (int(dy), int(dx)), dims=(1, 2))
                         for c, (dy, dx) in zip(labels.tolist(), shifts)])
        return x * contrast + 4.0 * torch.randn(x.shape, generator=g), labels

    def model(self):
        return torch.nn.Sequential(
            torch.nn.Conv2d(3, 32, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
            torch.nn.Conv2d(32, 64, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
            torch.nn.Flatten(), torch.nn.Linear(64 * 4 * 4, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10),
        )

    def batch_for(self, rank, step, seed=0):
        return self.images(torch.Generator().manual_seed(10_000 * step + rank + 10**9 * seed), self.batch)



class CharRNN(torch.nn.Module):
    """A one-layer GRU over bytes: recurrent, gated, its gradients unlike the others'."""

    def __init__(self, dim=64, hidden=256, vocab=256):
        super().__init__()
        self.tokens = torch.nn.Embedding(vocab, dim)
        self.gru = torch.nn.GRU(dim, hidden, batch_first=True)
        self.out = torch.nn.Linear(hidden, vocab)

    def forward(self, x):
        return self.out(self.gru(self.tokens(x))[0])


class CharRNNTask(GPTTask):
    """Next-byte prediction on the GPT task's text with a GRU instead of a transformer."""

    name = "charrnn"
    context = 48
    # Tuned for float32 allreduce, 300 steps, seeds 0 and 1: 2e-3, 3e-3, 5e-3, 1e-2 (and 3e-2
    # on seed 0) ended 1.752/1.734, 1.687/1.687, 1.667/1.608, 1.692/1.673 (1.977).
    lr = 5e-3

    def __init__(self, batch=16):
        super().__init__(batch=batch)

    def model(self):
        return CharRNN()


TASKS = {"gpt": GPTTask, "digits": DigitsTask, "shapes": ShapesTask, "charrnn": CharRNNTask}


# ---- one training run per method


def attach_method(method, ddp, model):
    """Registers the method's hook; returns a function giving payload bytes so far."""
    import cgx

    raw = sum(p.numel() * p.element_size() for p in model.parameters())
    if method == "allreduce":
        return lambda step: raw * step
    if method == "fp16":
        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
        return lambda step: raw // 2 * step
    if method == "powersgd":
        state = powerSGD_hook.PowerSGDState(None, matrix_approximation_rank=4,
                                            start_powerSGD_iter=WARMUP_STEPS, min_compression_rate=2)
        ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
        # PowerSGD counts only the compressed steps; its float32 warm-up is added here.
        return lambda step: raw * min(step, WARMUP_STEPS) + 4 * state.compression_stats()[2]
    parts = method.split("-")
    bits = 4 if parts[1:2] == ["adaptive"] else int(parts[0][3:])
    bucket_size = 128 if "bucket128" in parts else 512
    scheme = "hadamard" if "hadamard" in parts else "maxmin"
    adaptive = None
    if "adaptive" in parts:
        alpha = next((float(p[5:]) for p in parts if p.startswith("alpha")), 3.0)
        candidates = {} if scheme == "hadamard" else {"candidates": MAXMIN_CANDIDATES, "default": (4, 512)}
        adaptive = cgx.AdaptiveBits(**candidates, alpha=alpha, interval=50)
    feedback = None if method.endswith("-feedback-by-bits") else "no-feedback" not in method
    state = cgx.CGXState(None, model, cgx.CompressionPolicy(bits=bits, bucket_size=bucket_size, scheme=scheme),
                         warmup_steps=WARMUP_STEPS, adaptive=adaptive,
                         error_feedback=feedback, two_level="one-level" not in method)
    ddp.register_comm_hook(state, cgx.cgx_hook)
    return lambda step: state.stats()["payload_bytes"]


def shard_method(method, model):
    """FSDP2 on every block and the root, and cgx.qsdp for a qsdp method; returns a
    function giving (payload bytes, float32 bytes) so far (None for plain FSDP, whose
    float32 traffic is what the qsdp runs count as uncompressed)."""
    import cgx
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for block in model.blocks.layers:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    if method == "fsdp":
        return lambda step: (None, None)
    _, bits, *options = method.split("-")
    weight_bits, grad_bits = (int(b) for b in bits[1:].split("g"))
    bucket_size = next((int(o[len("bucket"):]) for o in options if o.startswith("bucket")), 512)
    policy = cgx.CompressionPolicy(bucket_size=bucket_size, scheme="hadamard" if "hadamard" in options else "maxmin")
    handle = cgx.qsdp(model, weight_bits=weight_bits, grad_bits=grad_bits, policy=policy,
                      weight_rounding="nearest" if "nearest" in options else "stochastic",
                      error_feedback="feedback" in options)

    def traffic(step):
        stats = handle.stats()
        kinds = [stats[k] for k in ("allgather", "reduce_scatter")]
        exact = sum(k["exact_bytes"] for k in kinds)
        return (sum(k["bytes_sent"] for k in kinds) + exact,
                sum(k["uncompressed_bytes"] for k in kinds) + exact)
    return traffic


def diloco_method(method, model, inner):
    """cgx.DiLoCo on the inner optimizer."""
    import cgx

    _, h, p, b, k, *variant = method.split("-")
    outer = {"lr": 0.7, "m": 0.9, "x": 0.5, "d": 1.0}  # the paper's outer lr and momentum, mix 0.5
    top_k = None
    for part in variant:
        if part.startswith(("top", "shared")):  # -topNofC / -sharedNofC: sparse, N of each chunk of C values
            k_, chunk = part.removeprefix("top").removeprefix("shared").split("of")
            top_k = (int(k_), int(chunk), part.startswith("shared"))
        elif part not in ("seq", "hadamard"):
            name = part.rstrip("0123456789.")
            outer[name] = float(part[len(name):])
    # The outer gradients in maxmin, or with -hadamard in that scheme (the group's default).
    policy = cgx.CompressionPolicy(bits=int(b[1:]), scheme="hadamard" if "hadamard" in variant else "maxmin")
    diloco = cgx.DiLoCo(model, inner, sync_every=int(h[1:]), fragments=int(p[1:]), policy=policy,
                        overlap=int(k[1:]), fragment_pattern="sequential" if "seq" in variant else "strided",
                        outer_lr=outer["lr"], outer_momentum=outer["m"], nesterov=outer["m"] > 0,
                        mix=outer["x"],
                        top_k=None if top_k is None else cgx.diloco.TopK(*top_k[:2], decay=outer["d"], shared=top_k[2]))
    return diloco


def run_method(rank, world, task_name, task_options, method, steps, seed, threads, init_method, out_path):
    import cgx  # noqa: F401  (backend "cgx")

    if threads:  # 0: torch's own choice (a thread per core in every rank)
        torch.set_num_threads(threads)
    dist.init_process_group("cgx", init_method=init_method, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=300))
    options = dict(task_options)
    lr = options.pop("lr", None)
    task = TASKS[task_name](**options)
    lr = lr or task.lr
    torch.manual_seed(seed)
    model = task.model()
    # One bucket for every method: torch's PowerSGD hook issues collectives from future
    # callbacks, and with several buckets their order differs between ranks (Gloo then
    # aborts with a size mismatch, with or without cgx underneath).
    dist._DEFAULT_FIRST_BUCKET_BYTES = 1 << 30
    float32 = sum(p.numel() * 4 for p in model.parameters())
    opt = None
    if method in FSDP_METHODS:
        ddp = model
        traffic = shard_method(method, model)
    elif is_diloco(method):
        ddp = model
        opt = torch.optim.AdamW(model.parameters(), lr=lr)
        diloco = diloco_method(method, model, opt)
        traffic = lambda step: (diloco.stats()["payload_bytes"], float32 * step)  # noqa: E731
    else:
        ddp = DDP(model, bucket_cap_mb=1024)
        bytes_so_far = attach_method(method, ddp, model)
        traffic = lambda step: (bytes_so_far(step), float32 * step)  # noqa: E731
    opt = opt or torch.optim.AdamW(model.parameters(), lr=lr)
    losses, step_ends = [], []
    phases = {"compute_seconds": 0.0, "optimizer_seconds": 0.0}  # forward+backward; step (with DiLoCo's hook)
    start = time.perf_counter()
    for step in range(steps):
        began = time.perf_counter()
        x, y = task.batch_for(rank, step, seed)
        loss = task.loss(ddp, x, y)
        opt.zero_grad()
        loss.backward()
        computed = time.perf_counter()
        opt.step()
        phases["compute_seconds"] += computed - began
        phases["optimizer_seconds"] += time.perf_counter() - computed
        avg = loss.detach().clone()
        dist.all_reduce(avg, op=dist.ReduceOp.AVG)  # an interleaved allreduce, as in real scripts
        losses.append(avg.item())
        step_ends.append(time.perf_counter() - start)
    elapsed = time.perf_counter() - start
    sent, float32 = traffic(steps)
    evaluation = task.evaluate(model)  # every rank: FSDP2 gathers its units in forward
    if rank == 0:
        if is_diloco(method):  # how long the inner loop waited on the link
            evaluation.update({k: diloco.stats()[k] for k in ("waits", "wait_seconds", "outer_syncs")})
        result = {"method": method, "losses": losses, "step_ends": step_ends, "seconds": elapsed, "steps": steps,
                  **phases,
                  "bytes_per_step": sent and sent / steps,
                  "float32_bytes_per_step": float32 and float32 / steps, **evaluation}
        with open(out_path, "w") as f:
            json.dump(result, f)
    dist.barrier()
    dist.destroy_process_group()


def run_on_emulated_hosts(call, world, rate, tmp, out):
    """One method's run with every rank on its own emulated host (root only); adds the
    bytes that crossed the links (all hosts, the whole run) to the result."""
    from launch import run_job
    from netemu import EmulatedHosts

    config = os.path.join(tmp, "rank-config.json")
    with open(config, "w") as f:
        json.dump({"call": call, "out": out}, f)
    with EmulatedHosts(world, rate=rate) as hosts:
        before = sum(hosts.bytes_sent())
        run_job([sys.executable, "-P", os.path.abspath(__file__), "--rank", config], world,
                hosts=hosts, timeout_s=3600)
        wire = sum(hosts.bytes_sent()) - before
    with open(out) as f:
        return dict(json.load(f), wire_bytes=wire, link=rate)


def rank_main(config_path):
    """A rank started by launch.run_job (torch's env:// variables set)."""
    with open(config_path) as f:
        config = json.load(f)
    run_method(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), *config["call"], "env://",
               config["out"])


def plot(results, task, path) -> bool:
    """Draws the loss curves into `path`; False where matplotlib is missing."""
    plt = pyplot()
    if plt is None:
        return False
    fig, ax = plt.subplots(figsize=(8, 5))
    for r in results:
        losses = torch.tensor(r["losses"])
        window = max(1, len(losses) // 30)
        smooth = torch.nn.functional.avg_pool1d(losses[None, None], window, 1).flatten()
        ax.plot(range(window - 1, len(losses)), smooth.tolist(), label=r["method"])
    ax.set_xlabel("step")
    ax.set_ylabel(f"training loss (moving average of {window})")
    ax.set_title(f"{task}: DDP convergence by gradient compression")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--task", choices=sorted(TASKS), default="gpt")
    parser.add_argument("--methods", nargs="+", type=method_name, metavar="METHOD",
                        default=["allreduce", "fp16", "powersgd", "cgx8", "cgx4", "cgx2", "cgx-adaptive", "fsdp",
                                 "qsdp-w8g8", "qsdp-w8g4", "qsdp-w4g4", "qsdp-w8g8-nearest", "qsdp-w4g4-nearest"])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0, help="model initialisation and data order")
    parser.add_argument("--gpt-dim", type=int, default=128, help="width of the GPT model")
    parser.add_argument("--gpt-depth", type=int, default=2, help="blocks of the GPT model")
    parser.add_argument("--gpt-batch", type=int, default=16, help="GPT sequences per rank and step")
    parser.add_argument("--lr", type=float, help="AdamW's learning rate (default: the task's)")
    parser.add_argument("--link", metavar="RATE",
                        help="run each rank on its own emulated host behind a link of this rate "
                             "(e.g. 1gbit; needs root); default: all ranks local")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch's intra-op threads per rank (0: torch's default, one per core)")
    parser.add_argument("--out", default=default_output("convergence"))
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    task_options = {"dim": args.gpt_dim, "depth": args.gpt_depth, "batch": args.gpt_batch} if args.task == "gpt" else {}
    if args.lr:
        task_options["lr"] = args.lr
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for method in args.methods:
            print(f"[{args.task}] {method} ...", flush=True)
            out = os.path.join(tmp, f"{method}.json")
            call = (args.task, task_options, method, args.steps, args.seed, args.threads)
            if args.link:
                results.append(run_on_emulated_hosts(call, args.world_size, args.link, tmp, out))
            else:
                mp.spawn(run_method, args=(args.world_size, *call,
                                           f"file://{os.path.join(tmp, method + '.store')}", out),
                         nprocs=args.world_size)
                with open(out) as f:
                    results.append(json.load(f))
    # Plain FSDP2 sends what the qsdp runs count as uncompressed.
    float32 = next((r["float32_bytes_per_step"] for r in results if r["float32_bytes_per_step"]), None)
    for r in results:
        if r["bytes_per_step"] is None:
            r["bytes_per_step"] = r["float32_bytes_per_step"] = float32
    base = results[0]
    metric = "val_accuracy" if args.task == "digits" else "val_loss"
    print(f"\n{args.task}, {args.world_size} ranks, {args.steps} steps, seed {args.seed}, "
          f"lr {args.lr or TASKS[args.task].lr}, link {args.link or 'local'}, "
          f"threads {args.threads or 'torch default'}, torch {torch.__version__}")
    print(f"| method | {metric} | val_loss vs {base['method']} | payload bytes/step/rank | "
          f"x fewer than float32 | s | steps/s | x {base['method']} steps/s | wire MiB/step |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in results:
        rel = r["val_loss"] / base["val_loss"] - 1
        wire = f"{r['wire_bytes'] / r['steps'] / 2**20:.2f}" if "wire_bytes" in r else ""
        payload, ratio = "n/a", "n/a"  # plain FSDP2 alone: nothing counted its bytes
        if r["bytes_per_step"]:
            payload = f"{r['bytes_per_step']:,.0f}"
            ratio = f"{r['float32_bytes_per_step'] / r['bytes_per_step']:.2f}"
        print(f"| {r['method']} | {r[metric]:.4f} | {rel:+.2%} | {payload} | {ratio} | {r['seconds']:.1f} | "
              f"{r['steps'] / r['seconds']:.2f} | {base['seconds'] / r['seconds']:.2f} | {wire} |")
    print("\nms per step on rank 0: forward+backward, optimizer step (with DiLoCo's syncs)")
    for r in results:
        print(f"  {r['method']}: {1e3 * r['compute_seconds'] / r['steps']:.1f}, "
              f"{1e3 * r['optimizer_seconds'] / r['steps']:.1f}")
    stem = os.path.join(args.out, args.task + (f"-seed{args.seed}" if args.seed else ""))
    with open(stem + ".json", "w") as f:
        json.dump({"task": args.task, "world_size": args.world_size, "steps": args.steps,
                   "seed": args.seed, "lr": args.lr or TASKS[args.task].lr, "results": results}, f)
    print(f"wrote {stem}.json" + (f" and {stem}.png" if plot(results, args.task, stem + ".png") else ""))


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--rank":
        rank_main(sys.argv[2])
    else:
        main()
