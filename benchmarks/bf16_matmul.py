"""How fast this CPU runs a Linear layer's three matmuls in bf16 against fp32, one thread.

    python benchmarks/bf16_matmul.py                    # tiny's and medium's shapes, 32 tokens
    python benchmarks/bf16_matmul.py --tokens 512 --shape 1000x64

A Linear layer's training step makes three matmuls: the forward ``x @ W.T``, the input gradient
``g @ W`` (W as stored, not transposed) and the weight gradient ``g.T @ x``. On a CPU without bf16
instructions torch computes bf16 matmuls with its own kernels, and their speed depends on the layout:
this prints each one's time in both dtypes, and the ratio. The guide's jobs train in bf16 by default,
so on such a CPU the step time (and the notebooks' running time) is mostly these kernels. Best of
``--repeat`` calls, interleaved (bf16, fp32, bf16, ...). Not a test.
"""

from __future__ import annotations

import argparse
import time

import torch

OPS = {"forward x @ W.T": lambda x, w, dy: x @ w.t(), "input grad dy @ W": lambda x, w, dy: dy @ w,
       "weight grad dy.T @ x": lambda x, w, dy: dy.t() @ x}


def best_ms(op, tensors: dict, repeat: int) -> dict:
    """The best of ``repeat`` calls per dtype, the dtypes taking turns (a slow spell hits both)."""
    times = {dtype: [] for dtype in tensors}
    for t in tensors.values():
        op(*t)  # warm-up
    for _ in range(repeat):
        for dtype, t in tensors.items():
            start = time.perf_counter()
            op(*t)
            times[dtype].append(time.perf_counter() - start)
    return {dtype: 1000 * min(v) for dtype, v in times.items()}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=32, help="rows of the activations (micro-batch x sequence)")
    ap.add_argument("--shape", action="append", help="OUTxIN of a Linear weight (repeatable; default: "
                    "medium's MLP 2752x1024 and tiny's 1000x64 head)")
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)  # as each rank of a 2-rank job on 2 cores (torchrun sets OMP_NUM_THREADS=1)
    print(f"torch {torch.__version__}, CPU capability {torch.backends.cpu.get_cpu_capability()}, 1 thread, "
          f"{args.tokens} tokens")
    for shape in args.shape or ["2752x1024", "1000x64"]:
        out, inp = (int(n) for n in shape.split("x"))
        g = torch.Generator().manual_seed(0)
        base = (torch.randn(args.tokens, inp, generator=g), torch.randn(out, inp, generator=g),
                torch.randn(args.tokens, out, generator=g))
        tensors = {dtype: [t.to(dtype) for t in base] for dtype in (torch.bfloat16, torch.float32)}
        for name, op in OPS.items():
            ms = best_ms(op, tensors, args.repeat)
            b, f = ms[torch.bfloat16], ms[torch.float32]
            print(f"W {shape:>10s}  {name:22s} bf16 {b:8.2f} ms   fp32 {f:8.2f} ms   bf16/fp32 x{b / f:6.1f}")

if __name__ == "__main__":
    main()
