"""loss-memory: the peak memory of one training micro-step (forward, loss, backward) and of one evaluation batch
(loss and accuracy per sample, no gradient) at a large vocabulary, with the loss computed at once against
objective.chunk_tokens (src/objectives/chunked.py). --objective dpo measures DPO on pairs instead (the batch's rows
are B/2 pairs, each answer the second half of its row), whose answers' log-probabilities the output layer computes
in chunks, the reference's (a frozen copy) too. --objective distill measures knowledge distillation from a frozen
teacher (a GPT of the same shape): chunked, both terms through the student's output layer, the teacher's logits
made there from its last hidden states, a chunk at a time.

Both sides run the template's own Forward on the same GPT (tied output layer), batch and targets, each in a fresh
process: one warm-up step (so the gradients exist), then the peak is reset and one more step measured. On CPU the
peak is the process's resident memory (VmHWM, reset through /proc/self/clear_refs) over what it held before the
step; on CUDA, torch.cuda.max_memory_allocated over the memory allocated before it. The evaluation batch is measured
the same way after the step. The loss of both is printed too: equal within float rounding.
"""

import json
import subprocess
import sys

from scripts.benchmarks.common import BENCHMARK, ROOT


def loss_memory(args) -> dict:
    sides = {}
    for chunk in (0, args.chunk_tokens):
        done = subprocess.run([sys.executable, str(BENCHMARK), "_loss_memory", "--vocab", str(args.vocab),
                               "--tokens", str(args.tokens), "--batch", str(args.batch), "--n-embd", str(args.n_embd),
                               "--chunk-tokens", str(chunk), "--device", args.device, "--objective", args.objective],
                              cwd=ROOT, capture_output=True, text=True, check=True)
        sides["chunk_tokens=" + (str(chunk) if chunk else "null")] = json.loads(done.stdout.splitlines()[-1])
    plain, chunked = sides.values()
    return {**sides, "peak_ratio_plain_over_chunked": _ratio(plain["step_peak_gib"], chunked["step_peak_gib"]),
            "eval_peak_ratio_plain_over_chunked": _ratio(plain["eval_peak_gib"], chunked["eval_peak_gib"]),
            "loss_difference": abs(plain["loss"] - chunked["loss"])}


def _ratio(plain: float, chunked: float):
    """None where the chunked side's peak is below what resident memory shows (a small size on CPU: memory the
    warm-up step freed is used again, and the high-water mark does not move)."""
    return round(plain / chunked, 2) if chunked > 0 else None


def _worker(args) -> None:
    import torch

    from src.loop.forward import Forward
    from src.models.gpt import GPT
    from src.objectives.classification import CrossEntropy

    device = torch.device(args.device)
    torch.manual_seed(0)
    model = GPT(vocab_size=args.vocab, block_size=args.tokens, n_layer=2, n_head=4, n_embd=args.n_embd).to(device)
    x = torch.randint(0, args.vocab, (args.batch, args.tokens), device=device)
    y = torch.randint(0, args.vocab, (args.batch, args.tokens), device=device)
    if args.objective == "causal_lm":
        forward = Forward(CrossEntropy(chunk_tokens=args.chunk_tokens or None), compile=False)
    elif args.objective == "distill":
        from accelerate import Accelerator

        from src.objectives.distillation import Distillation

        objective = Distillation(teacher="a GPT of the student's shape", chunk_tokens=args.chunk_tokens or None)
        teacher = GPT(vocab_size=args.vocab, block_size=args.tokens, n_layer=2, n_head=4, n_embd=args.n_embd)
        objective.teacher = teacher.to(device).requires_grad_(False).eval()  # what start() leaves, from a folder
        objective.accelerator, objective._sums = Accelerator(cpu=device.type == "cpu"), torch.zeros(2, device=device)
        forward = Forward(objective, compile=False)
    else:  # rows: chosen answers then rejected ones, each after a prompt of half the row that counts for nothing
        from accelerate import Accelerator

        from src.objectives.preference import DPO

        objective = DPO(reference="copy", chunk_tokens=args.chunk_tokens or None)
        objective.start(Accelerator(cpu=device.type == "cpu"), model, None, None, None)
        x, y = {"input_ids": x, "pair_index": torch.arange(args.batch // 2, device=device)}, x.clone()
        y[:, :args.tokens // 2] = -100
        forward = Forward(objective, compile=False)
    forward.loss_sum(model, x, y).backward()  # the gradients exist from here on, as in training
    before = held(device)
    reset_peak(device)
    loss = forward.loss_sum(model, x, y)
    loss.backward()
    step_peak = peak(device) - before
    model.eval()
    with torch.no_grad():
        before = held(device)
        reset_peak(device)
        forward.metrics(model, x, y)
        eval_peak = peak(device) - before
    print(json.dumps({"step_peak_gib": round(step_peak / 2**30, 3), "eval_peak_gib": round(eval_peak / 2**30, 3),
                      "loss": loss.item(),
                      "logits_fp32_gib": round(args.batch * args.tokens * args.vocab * 4 / 2**30, 3)}))


def held(device) -> int:
    import torch

    return torch.cuda.memory_allocated(device) if device.type == "cuda" else _status_kib("VmRSS") * 1024


def reset_peak(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    else:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current resident size


def peak(device) -> int:
    import torch

    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else _status_kib("VmHWM") * 1024


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def add_commands(commands) -> dict:
    c = commands.add_parser("loss-memory", help="a micro-step's peak memory at a large vocabulary, chunked loss or not")
    w = commands.add_parser("_loss_memory")
    for parser in (c, w):
        parser.add_argument("--vocab", type=int, default=128256, help="Llama 3's vocabulary")
        parser.add_argument("--tokens", type=int, default=512)
        parser.add_argument("--batch", type=int, default=4)
        parser.add_argument("--n-embd", type=int, default=256)
        parser.add_argument("--device", default="cuda" if _has_cuda() else "cpu")
        parser.add_argument("--objective", choices=["causal_lm", "dpo", "distill"], default="causal_lm",
                            help="dpo: --batch rows of pairs against a frozen reference copy; distill: from a frozen "
                                 "teacher of the same shape")
    c.add_argument("--chunk-tokens", type=int, default=256)
    w.add_argument("--chunk-tokens", type=int, default=0)
    return {"loss-memory": loss_memory, "_loss_memory": _worker}


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()
