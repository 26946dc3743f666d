"""Kernel warm-up: compile the Triton kernels a job will use, for this pod's GPU, before training starts.

Triton compiles a kernel the first time it runs with a new specialization (dtype, block sizes
derived from the hidden size, integer arguments divisible by 16, the GPU's architecture) and keeps
the binary in TRITON_CACHE_DIR. The training image's entrypoint runs this module first, with the
cache on a persistent volume: the first pod on a GPU type pays the compile time, later pods and
restarts load the binaries. Each op runs forward and backward once at the job's sizes, its output
is compared with the pure-PyTorch reference, and the time it took is logged. By default these are the
ops tigon.kernels.patching swaps into the model family, and the fused linear cross entropy loss (the
runtime's default) at the model's hidden size and vocabulary.

    python -m tigon.kernels.warmup --hidden 4096 --intermediate 14336 --heads 32 --kv-heads 8 --vocab 128256
    python -m tigon.kernels.warmup --model-config /models/llama-3-8b/config.json --json /tmp/warmup.json

Without a GPU it runs Triton's interpreter (TRITON_INTERPRET=1) on tiny shapes instead: nothing is
compiled or cached then, but every kernel the job would use has run once and been checked.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

logger = logging.getLogger("tigon.kernels.warmup")

OPS = (
    "rms_norm",
    "fused_add_rms_norm",
    "layer_norm",
    "rope",
    "swiglu",
    "geglu",
    "swiglu_packed",
    "relu_squared",
    "cross_entropy",
    "fused_linear_cross_entropy",
)
DTYPES = ("float32", "bfloat16", "float16")
# Relative error ||out - ref|| / ||ref|| allowed per dtype (docs/architecture.md, "Exactness": fp32 1e-5, bf16 1e-2).
TOLERANCE = {"float32": 1e-5, "bfloat16": 1e-2, "float16": 2e-3}
# On the CPU the interpreter runs each program in Python: shapes are clamped to these.
TINY = {"tokens": 8, "hidden": 64, "intermediate": 96, "heads": 2, "kv_heads": 1, "head_dim": 16, "vocab": 37}
# The final logit softcap the loss runs with in families that softcap (Gemma 2/3's value): only whether there
# is one changes the compiled kernel, not its value.
SOFTCAP = 30.0
MAX_HIDDEN = 65536


class WarmupError(ValueError):
    """Bad warm-up arguments; the message names the argument and the fix."""


@dataclass(frozen=True)
class Shapes:
    """The sizes a job's kernels see: the model's dimensions and tokens per micro-batch."""

    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    tokens: int
    vocab: int = 128256  # Llama 3's vocabulary

    def check(self) -> None:
        for name, value in asdict(self).items():
            if not isinstance(value, int) or value <= 0:
                raise WarmupError(f"{name} must be a positive integer, got {value!r}")
        if self.hidden > MAX_HIDDEN:
            raise WarmupError(f"hidden {self.hidden} is above the {MAX_HIDDEN} the norm kernels hold in one pass")
        if self.head_dim % 2:
            raise WarmupError(f"head_dim must be even for RoPE, got {self.head_dim}")

    def tiny(self) -> Shapes:
        return Shapes(**{name: min(value, TINY[name]) for name, value in asdict(self).items()})


@dataclass
class OpResult:
    op: str
    shapes: str
    dtype: str
    seconds: float
    error: float | None = None
    failure: str | None = None

    @property
    def ok(self) -> bool:
        return self.failure is None


@dataclass
class WarmupReport:
    """What ran, where, how long each op took, and how the cache changed."""

    mode: str  # "cuda" (compiled into the cache), "interpreter" (CPU, nothing compiled) or "reference"
    device: str
    cache_dir: str
    family: str
    results: list[OpResult] = field(default_factory=list)
    cache_files_before: int = 0
    cache_files_after: int = 0
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return all(result.ok for result in self.results)

    def lines(self) -> list[str]:
        head = f"tigon kernel warm-up on {self.device} ({self.mode}), family {self.family}, cache {self.cache_dir}"
        out = [head]
        for r in self.results:
            status = f"max rel. error {r.error:.1e}" if r.ok else f"FAILED: {r.failure}"
            out.append(f"  {r.op:<20s} {r.dtype:<9s} {r.shapes:<40s} {r.seconds:7.2f} s  {status}")
        new = self.cache_files_after - self.cache_files_before
        if self.mode == "cuda":
            warmth = "cold: compiled" if new else "warm: every kernel loaded from the cache"
            cache = f"{new} new cache files ({warmth})"
        else:
            cache = "nothing compiled or cached (no GPU)"
        out.append(f"  total {self.seconds:.2f} s; {cache}")
        return out

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["ok"] = self.ok
        return data


def count_cache_files(cache_dir: str | os.PathLike) -> int:
    path = Path(cache_dir)
    return sum(1 for p in path.rglob("*") if p.is_file()) if path.is_dir() else 0


def default_cache_dir() -> str:
    return os.environ.get("TRITON_CACHE_DIR") or str(Path.home() / ".triton" / "cache")


def family_settings(family: str) -> dict[str, Any]:
    """What `tigon.kernels.patching` swaps into a model family: norm casting and offset, activation."""
    from tigon.kernels.patching import FAMILIES

    if family not in FAMILIES:
        raise WarmupError(f"unknown model family {family!r}; tigon patches: {', '.join(sorted(FAMILIES))}")
    spec = FAMILIES[family].installed()
    return {
        "casting": "gemma" if spec.gemma_norm else spec.norm_casting,
        "offset": 1.0 if spec.gemma_norm else 0.0,
        "in_place_backward": spec.in_place_norm_backward,
        "softcap": SOFTCAP if spec.final_logit_softcapping else None,
        # The loss: the runtime's kernels.fused_linear_cross_entropy is on by default.
        "ops": (
            "rms_norm",
            "fused_add_rms_norm",
            "rope",
            *(("layer_norm",) if spec.offset_layer_norm or spec.layer_norm else ()),  # Nemotron's, vision towers'
            # separate gate/up projections run the activation; a fused gate_up_proj (Phi-3, GLM-4) and MoE experts
            # run the packed one
            *((("geglu" if spec.gemma_norm else "swiglu"),) if spec.mlp or spec.expert_mlp else ()),
            *(("swiglu_packed",) if spec.packed_mlp or spec.experts else ()),
            *(("relu_squared",) if spec.activations else ()),  # Nemotron's MLP activation
            "fused_linear_cross_entropy",
        ),
    }


def _relative_error(out, ref) -> float:
    import torch

    out, ref = out.detach().double(), ref.detach().double()
    if not torch.isfinite(out).all():
        return float("nan")
    return float(torch.linalg.vector_norm(out - ref) / torch.linalg.vector_norm(ref).clamp_min(1e-30))


def _run_op(op: str, shapes: Shapes, dtype, device, settings: dict[str, Any]):
    """Run `op` forward and backward once; returns (outputs, reference outputs)."""
    import torch

    from tigon.kernels import functional, reference

    g = torch.Generator(device="cpu").manual_seed(0)

    def rand(*size, grad=True):
        t = torch.randn(*size, generator=g, dtype=torch.float32).to(device=device, dtype=dtype)
        return t.requires_grad_(grad)

    t, h = shapes.tokens, shapes.hidden
    norm = {"eps": 1e-6, "offset": settings["offset"], "casting": settings["casting"]}
    if op == "rms_norm":
        x, w = rand(t, h), rand(h)
        out = (functional.rms_norm(x, w, in_place_backward=settings["in_place_backward"], **norm),)
        ref = (reference.rms_norm(x.detach(), w.detach(), **norm),)
        inputs = (x, w)
    elif op == "fused_add_rms_norm":
        x, r, w = rand(t, h), rand(t, h), rand(h)
        out = functional.fused_add_rms_norm(x, r, w, in_place_backward=settings["in_place_backward"], **norm)
        ref = reference.fused_add_rms_norm(x.detach(), r.detach(), w.detach(), **norm)
        inputs = (x, r, w)
    elif op == "layer_norm":
        x, w, b = rand(t, h), rand(h), rand(h)
        out = (functional.layer_norm(x, w, b),)
        ref = (reference.layer_norm(x.detach(), w.detach(), b.detach()),)
        inputs = (x, w, b)
    elif op == "rope":
        q, k = rand(1, shapes.heads, t, shapes.head_dim), rand(1, shapes.kv_heads, t, shapes.head_dim)
        angles = torch.rand(1, t, shapes.head_dim // 2, generator=g).repeat(1, 1, 2).to(device) * 6.283
        cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
        out = functional.rope(q, k, cos, sin)
        ref = reference.rope(q.detach(), k.detach(), cos, sin)
        inputs = (q, k)
    elif op in ("swiglu", "geglu"):
        gate, up = rand(t, shapes.intermediate), rand(t, shapes.intermediate)
        out = (getattr(functional, op)(gate, up),)
        ref = (getattr(reference, op)(gate.detach(), up.detach()),)
        inputs = (gate, up)
    elif op == "swiglu_packed":
        gate_up = rand(t, 2 * shapes.intermediate)
        out = (functional.swiglu_packed(gate_up),)
        ref = (reference.swiglu_packed(gate_up.detach()),)
        inputs = (gate_up,)
    elif op == "relu_squared":
        x = rand(t, shapes.intermediate)
        out = (functional.relu_squared(x),)
        ref = (reference.relu_squared(x.detach()),)
        inputs = (x,)
    elif op == "cross_entropy":
        logits, target = rand(t, shapes.vocab), _targets(t, shapes.vocab, g, device)
        # First the reference: the kernel writes the gradient over the logits.
        ref = (reference.cross_entropy(logits.detach().clone(), target, softcap=settings["softcap"]),)
        out = (functional.cross_entropy(logits, target, softcap=settings["softcap"]),)
        inputs = (logits,)
    elif op == "fused_linear_cross_entropy":
        x, w, target = rand(t, h), rand(shapes.vocab, h), _targets(t, shapes.vocab, g, device)
        loss = {"softcap": settings["softcap"]}
        out = (functional.fused_linear_cross_entropy(x, w, target, **loss),)
        ref = (reference.fused_linear_cross_entropy(x.detach(), w.detach(), target, **loss),)
        inputs = (x, w)
    else:
        raise WarmupError(f"unknown op {op!r}; choose from {', '.join(OPS)}")
    grads = [torch.ones_like(o) for o in out]
    torch.autograd.grad(out, inputs, grads)
    return out, ref


def _targets(tokens: int, vocab: int, g, device):
    """Class indices for the losses, the last token ignored (-100) as the shifted labels' last one is."""
    import torch

    target = torch.randint(0, vocab, (tokens,), generator=g)
    target[-1] = -100
    return target.to(device)


def _describe(op: str, shapes: Shapes) -> str:
    if op == "rope":
        return f"heads={shapes.heads}/{shapes.kv_heads} head_dim={shapes.head_dim} seq={shapes.tokens}"
    if op == "cross_entropy":
        return f"tokens={shapes.tokens} vocab={shapes.vocab}"
    if op == "fused_linear_cross_entropy":
        return f"tokens={shapes.tokens} hidden={shapes.hidden} vocab={shapes.vocab}"
    size = shapes.intermediate if op in ("swiglu", "geglu", "swiglu_packed", "relu_squared") else shapes.hidden
    return f"tokens={shapes.tokens} width={size}"


def warm_up(
    shapes: list[Shapes],
    dtype: str | None = None,
    ops: list[str] | None = None,
    family: str = "llama",
    device: str | None = None,
    cache_dir: str | None = None,
) -> WarmupReport:
    """Run every op once (forward and backward) at each of `shapes`; log and return a report.

    `device=None` uses the GPU when there is one. On the CPU, shapes are clamped to tiny ones and the
    kernels run through Triton's interpreter (TRITON_INTERPRET=1 must be set before triton is imported;
    the CLI does that); without the interpreter the reference runs and the report says so.
    """
    import torch

    settings = family_settings(family)
    ops = list(ops or settings["ops"])
    unknown = [op for op in ops if op not in OPS]
    if unknown:
        raise WarmupError(f"unknown op(s) {unknown}; choose from {', '.join(OPS)}")
    if not shapes:
        raise WarmupError("no shapes to warm up: give at least one --hidden size")
    for s in shapes:
        s.check()
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise WarmupError("device cuda requested but no CUDA GPU is visible (check the pod's nvidia.com/gpu limit)")
    dtype = dtype or ("bfloat16" if device.startswith("cuda") else "float32")
    if dtype not in DTYPES:
        raise WarmupError(f"dtype {dtype!r} is not one of {DTYPES}")
    if cache_dir:
        os.environ["TRITON_CACHE_DIR"] = str(cache_dir)  # read when Triton first writes a kernel
    cache_dir = default_cache_dir()

    from tigon.kernels.utils import interpreter_active

    if device.startswith("cuda"):
        mode, name = "cuda", torch.cuda.get_device_name(torch.device(device))
        Path(cache_dir).mkdir(parents=True, exist_ok=True)
    else:
        mode, name = ("interpreter" if interpreter_active() else "reference"), "cpu"
        shapes = list(dict.fromkeys(s.tiny() for s in shapes))

    report = WarmupReport(mode=mode, device=name, cache_dir=cache_dir, family=family)
    report.cache_files_before = count_cache_files(cache_dir)
    torch_dtype = getattr(torch, dtype)
    start = time.perf_counter()
    for s in shapes:
        for op in ops:
            began = time.perf_counter()
            result = OpResult(op=op, shapes=_describe(op, s), dtype=dtype, seconds=0.0)
            try:
                out, ref = _run_op(op, s, torch_dtype, device, settings)
                if mode == "cuda":
                    torch.cuda.synchronize(device)
                result.error = max(_relative_error(o, r) for o, r in zip(out, ref, strict=True))
                if not result.error <= TOLERANCE[dtype]:
                    result.failure = f"relative error {result.error:.2e} above {TOLERANCE[dtype]:.0e} vs the reference"
            except Exception as error:  # a warm-up reports every op, then fails as a whole
                result.failure = f"{type(error).__name__}: {error}"
            result.seconds = time.perf_counter() - began
            report.results.append(result)
            log = logger.info if result.ok else logger.error
            log(
                "%s %s %s: %.2f s%s",
                op,
                dtype,
                result.shapes,
                result.seconds,
                "" if result.ok else f" ({result.failure})",
            )
    report.seconds = time.perf_counter() - start
    report.cache_files_after = count_cache_files(cache_dir)
    if mode == "reference":
        logger.warning("no GPU and no TRITON_INTERPRET=1: the PyTorch references ran, no Triton kernel did")
    return report


def shapes_from_model_config(path: str | os.PathLike) -> tuple[dict[str, int], str]:
    """Sizes and family from a Hugging Face config.json (no transformers import)."""
    path = Path(path)
    if path.is_dir():
        path = path / "config.json"
    try:
        config = json.loads(path.read_text())
    except FileNotFoundError:
        raise WarmupError(f"model config {path} does not exist; pass a config.json or its directory") from None
    except json.JSONDecodeError as error:
        raise WarmupError(f"model config {path} is not valid JSON: {error}") from None
    config = config.get("text_config", config)
    missing = [key for key in ("hidden_size", "num_attention_heads") if key not in config]
    if missing:
        raise WarmupError(f"model config {path} has no {', '.join(missing)}")
    heads = config["num_attention_heads"]
    sizes = {
        "hidden": config["hidden_size"],
        "intermediate": config.get("intermediate_size") or 4 * config["hidden_size"],
        "heads": heads,
        "kv_heads": config.get("num_key_value_heads") or heads,
        "head_dim": config.get("head_dim") or config["hidden_size"] // heads,
    }
    if config.get("vocab_size"):
        sizes["vocab"] = config["vocab_size"]
    return sizes, family_of(str(config.get("model_type", "")))


def family_of(model_type: str) -> str:
    """The patching family of a config's model_type (gemma2 softcaps its logits, gemma does not); llama otherwise."""
    from tigon.kernels.patching import FAMILIES

    if model_type in FAMILIES:
        return model_type
    return "gemma" if model_type.startswith("gemma") else "llama"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m tigon.kernels.warmup",
        description="Compile the Triton kernels a job uses, for this GPU, into TRITON_CACHE_DIR.",
    )
    parser.add_argument("--hidden", type=int, nargs="+", help="hidden size(s) of the model(s), e.g. 4096")
    parser.add_argument("--intermediate", type=int, help="MLP intermediate size (default 4 x hidden)")
    parser.add_argument("--heads", type=int, help="attention heads (default hidden / head-dim)")
    parser.add_argument("--kv-heads", type=int, help="key/value heads (default: --heads)")
    parser.add_argument("--head-dim", type=int, default=128, help="head dimension (default 128)")
    parser.add_argument("--tokens", type=int, default=4096, help="tokens per micro-batch (batch x sequence length)")
    parser.add_argument("--vocab", type=int, default=Shapes.vocab, help=f"vocabulary size (default {Shapes.vocab})")
    parser.add_argument("--model-config", help="a Hugging Face config.json (or its directory) to take the sizes from")
    parser.add_argument("--family", help="tigon.kernels.patching family: llama (default), qwen3, gemma, gemma2, ...")
    parser.add_argument("--ops", help=f"comma-separated ops (default: the family's); from {','.join(OPS)}")
    parser.add_argument("--dtype", choices=DTYPES, help="default bfloat16 on a GPU, float32 on the CPU")
    parser.add_argument("--device", help="cuda, cuda:N or cpu (default: cuda when available)")
    parser.add_argument("--cache-dir", help="Triton cache directory (default: $TRITON_CACHE_DIR)")
    parser.add_argument("--json", help="also write the report here as JSON")
    return parser


def _build_shapes(args: argparse.Namespace) -> tuple[list[Shapes], str]:
    family = args.family
    if args.model_config:
        sizes, config_family = shapes_from_model_config(args.model_config)
        family = family or config_family
        sizes.setdefault("vocab", args.vocab)  # a config without vocab_size
        return [Shapes(tokens=args.tokens, **sizes)], family
    if not args.hidden:
        raise WarmupError("give --hidden (e.g. --hidden 4096) or --model-config path/to/config.json")
    shapes = []
    for hidden in args.hidden:
        heads = args.heads or max(1, hidden // args.head_dim)
        shapes.append(
            Shapes(
                hidden=hidden,
                intermediate=args.intermediate or 4 * hidden,
                heads=heads,
                kv_heads=args.kv_heads or heads,
                head_dim=args.head_dim,
                tokens=args.tokens,
                vocab=args.vocab,
            )
        )
    return shapes, family or "llama"


def _write_json(path: str, data: dict) -> None:
    """Write to a temporary name and rename into place: never a half-written report."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(f".{target.name}.partial")
    partial.write_text(json.dumps(data, indent=2) + "\n")
    partial.replace(target)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if args.cache_dir:
        os.environ["TRITON_CACHE_DIR"] = args.cache_dir
    wants_gpu = (args.device or "cuda").startswith("cuda")
    if "triton" not in sys.modules and not (wants_gpu and _cuda_available()):
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: the CPU runs the kernels
    try:
        shapes, family = _build_shapes(args)
        ops = [op.strip() for op in args.ops.split(",") if op.strip()] if args.ops else None
        report = warm_up(shapes, dtype=args.dtype, ops=ops, family=family, device=args.device)
    except WarmupError as error:
        print(f"warm-up: {error}", file=sys.stderr)
        return 2
    for line in report.lines():
        print(line)
    if args.json:
        _write_json(args.json, report.to_json())
    return 0 if report.ok else 1


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


if __name__ == "__main__":
    sys.exit(main())
