import sys
from vismmoe_kt.runtime import decode_boundary
from benchmarks import boundary_upkeep
decode_boundary.LANDING_SHARE = float(sys.argv[1])
boundary_upkeep.main(["--rules", "optimize_rules/qwen3vl-lru.yaml", "optimize_rules/qwen3vl.yaml", "--slabs", sys.argv[2], "--decode_tokens", "32"])
