"""The demo picture's six questions through optimize_rules/qwen3vl.yaml on the CPU, per setting.

    PYTHONPATH=. python benchmarks/results/2026-12-01/cpu-make-demo-rules/six_questions.py expert_budget=7MiB,pinned_layers=2,prune_layer=3 ...

Each argument is one setting (comma-separated rule kwargs, values read as YAML); one line per setting:
pinned layers, slabs, fetches and evictions over the six questions, visual tokens before/after pruning,
each answer with a mark (right or wrong). BENCHMARKS.md (make demo's rules) has the results.
"""
import sys, yaml, torch
import vismmoe_kt
from vismmoe_kt.demo.tiny import demo_model_dir
from vismmoe_kt.demo.pictures import make_vqa_image, DEMO_QUESTIONS
from vismmoe_kt.engine.inputs import ask_inputs
torch.set_num_threads(1)
img = make_vqa_image()
for cfg in sys.argv[1:]:
    kw = {k: yaml.safe_load(v) for k, v in (p.split("=") for p in cfg.split(","))}
    model, proc = vismmoe_kt.load(demo_model_dir(), "optimize_rules/qwen3vl.yaml", generate_device="cpu", prefill_device="cpu", **kw)
    res = []
    for q, a in DEMO_QUESTIONS.items():
        inp = ask_inputs(model, proc, q, [img])
        ids = vismmoe_kt.generate(model, inp, 8)
        r = proc.tokenizer.decode(ids[0, inp["input_ids"].shape[1]:], skip_special_tokens=True).strip()
        res.append(f"{r}{'✓' if r.rstrip('.').lower()==a else '✗'}")
    s = vismmoe_kt.stats(model)["operators"]
    ve = s.get("VisExperts", {}); vd = s.get("VisDecoder", {})
    print(cfg, "pinned", ve.get("pinned_layers"), "slabs", ve.get("slabs"), "fetches", ve.get("fetches"), "evict", ve.get("evictions"), "pruned", vd.get("pruned_prefills"), vd.get("visual_tokens_before"), vd.get("visual_tokens_after"), " | ".join(res), flush=True)
