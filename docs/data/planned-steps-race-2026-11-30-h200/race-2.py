"""Temporary: are planned caches deterministic across caches in generate (eager)?"""
import os, subprocess, sys, json
variant = sys.argv[1] if len(sys.argv) > 1 else None
if variant is None:
    for v in os.environ.get("VARIANTS", "base rowcache0 S128 S256 n1000 sync_before sync_after sync_both "
                            "side_stream eagerplan group512 topk").split():
        r = subprocess.run([sys.executable, __file__, v], capture_output=True, text=True)
        print(v, r.stdout.strip()[-700:], r.stderr.strip()[-600:] if r.returncode else "", flush=True)
    sys.exit(0)
import torch, transformers
import kvsparse, kvsparse.torch.hf as khf
from kvsparse.torch import ops
cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=256, intermediate_size=512, num_hidden_layers=3,
    num_attention_heads=8, num_key_value_heads=2, head_dim=64, max_position_embeddings=2048, initializer_range=0.08,
    pad_token_id=0, bos_token_id=1, eos_token_id=None)
torch.manual_seed(0)
model = khf.enable(transformers.LlamaForCausalLM(cfg).to("cuda", torch.bfloat16).eval())
N = 1000 if variant == "n1000" else 1500
ids = torch.randint(2, 256, (2, N), generator=torch.Generator().manual_seed(3)).to("cuda")
S = {"S128": 128, "S256": 256}.get(variant, 512)
method = kvsparse.Santa(samples=S, scores="compressed")
if variant == "group512": method = kvsparse.Santa(samples=512, scores="compressed", proposal="group")
if variant == "topk": method = kvsparse.TopK(top_k_fraction=0.5, scores="compressed")
orig = ops.DecodeSteps.decode
def wrapped(self, *a, **k):
    if variant in ("sync_before", "sync_both"): torch.cuda.synchronize()
    r = orig(self, *a, **k)
    if variant in ("sync_after", "sync_both"): torch.cuda.synchronize()
    return r
ops.DecodeSteps.decode = wrapped
eng_kw = {"gpu_row_cache": 0.0} if variant == "rowcache0" else {}
got = []
stream = torch.cuda.Stream() if variant == "side_stream" else torch.cuda.current_stream()
with ops.InProcessEngine(store_capacity="2G", gpu="on", **eng_kw) as engine, torch.cuda.stream(stream):
    for i in range(4):
        kw = {}
        with khf.KvSparseCache(model.config, engine, method=method, max_tokens=N + 20, **kw) as cache:
            if variant == "eagerplan":
                o = cache._plan
                def p(o=o, cache=cache):
                    cache.__dict__.pop("_plan", None)
                    eng = cache._engine
                    pe = eng.plan_steps
                    eng.plan_steps = lambda *a, **k: pe(*a, **{**k, "eager": True})
                    try: o()
                    finally: eng.plan_steps = pe
                cache._plan = p
            with torch.no_grad():
                out = model.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=0, past_key_values=cache)
            mode = cache.steps.mode if cache.steps is not None else None
        got.append(out[:, N:].tolist())
print(json.dumps({"mode": str(mode)[:40], "equal": all(g == got[0] for g in got), "tokens": [g[0] for g in got]}))
