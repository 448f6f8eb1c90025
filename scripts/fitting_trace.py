"""A routing trace whose experts fit a cache: each MoE layer routes only among a fixed working set.

Replayed with `--routing trace:PATH`, every decode expert is resident once the prompt has filled the
cache, so an offloaded run measures the decode path's own cost against the all-resident one (the
"every routed expert already resident" benchmark).

    python3 scripts/fitting_trace.py OUT.safetensors [--layers 48] [--experts 128] [--top_k 8]
        [--working_set 32] [--tokens 4096] [--seed 0]
"""


import torch

from vismmoe_kt.routing.formats import save_trace
from vismmoe_kt.apps.arguments import FlagParser, RawHelpFormatter


def main() -> None:
    parser = FlagParser(description=__doc__, formatter_class=RawHelpFormatter)
    parser.add_argument("out", help="trace file to write (.safetensors)")
    parser.add_argument("--layers", type=int, default=48, help="MoE layers")
    parser.add_argument("--experts", type=int, default=128, help="routed experts per layer")
    parser.add_argument("--top_k", type=int, default=8, help="experts each token is routed to")
    parser.add_argument("--working_set", type=int, default=32, help="experts each layer routes among")
    parser.add_argument("--tokens", type=int, default=4096, help="tokens in the trace")
    parser.add_argument("--seed", type=int, default=0, help="seed of the working sets and the routing")
    args = parser.parse_args()
    if not args.top_k <= args.working_set <= args.experts:
        parser.error("need --top_k <= --working_set <= --experts")
    generator = torch.Generator().manual_seed(args.seed)
    sets = torch.stack([torch.randperm(args.experts, generator=generator)[:args.working_set] for _ in range(args.layers)])
    # per token and layer: top-k distinct members of the layer's set
    picks = torch.rand(args.tokens, args.layers, args.working_set, generator=generator).argsort(dim=-1)[..., :args.top_k]
    ids = torch.gather(sets.expand(args.tokens, -1, -1), 2, picks)
    print(save_trace(args.out, ids))


if __name__ == "__main__":
    main()
