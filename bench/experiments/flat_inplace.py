"""Which way of running an elementwise optimizer over one flat 1.72B buffer reaches the metal?"""
import statistics, sys, time, torch
sys.path.insert(0, ".")
from pgs.func.kernels.elementwise import adamw_step_, lion_step_

def bench(fn, iters=20, warm=3):
    for _ in range(warm): fn()
    torch.cuda.synchronize(); ts = []
    for _ in range(iters):
        a, b = torch.cuda.Event(True), torch.cuda.Event(True); a.record(); fn(); b.record(); torch.cuda.synchronize(); ts.append(a.elapsed_time(b))
    return statistics.median(ts)

n = 1_720_000_000 if len(sys.argv) < 2 else int(sys.argv[1])
dev = "cuda"; bf = torch.bfloat16
p = torch.randn(n, device=dev, dtype=bf) * 0.02; g = torch.randn(n, device=dev, dtype=bf) * 1e-3
m = torch.zeros(n, device=dev, dtype=bf); v = torch.zeros(n, device=dev, dtype=bf)
x = torch.empty(n, device=dev, dtype=bf)
bw = 2 * n * 2 / (bench(lambda: x.copy_(p)) / 1e3); del x
print(f"copy bw {bw/1e9:.0f} GB/s", flush=True)
lr = torch.tensor(1e-4, device=dev)

def lion_fn(p, g, m, lr):
    c = m.float().lerp(g.float(), 0.1).sign()
    u = c + 0.1 * p.float()
    return (p.float() - lr * u).to(bf), m.float().lerp(g.float(), 0.01).to(bf)

def lion_inplace(p, g, m, lr):
    np_, nm = lion_fn(p, g, m, lr); p.copy_(np_); m.copy_(nm)

res = {}
f1 = torch.compile(lion_fn)
res["lion compile functional"] = (bench(lambda: f1(p, g, m, lr)), 10)
f2 = torch.compile(lion_inplace)
res["lion compile inplace"] = (bench(lambda: f2(p, g, m, lr)), 10)
CH = 1 << 28
pc, gc, mc = p.split(CH), g.split(CH), m.split(CH)
res["lion compile inplace chunked 2^28"] = (bench(lambda: [f2(a, b, c, lr) for a, b, c in zip(pc, gc, mc)]), 10)
sc = torch.tensor([1e-4, 0.1, 0.01], device=dev, dtype=torch.float32)
res["lion triton inplace"] = (bench(lambda: lion_step_(p, g, m, sc, 0.9, 0.99, 0.1)), 10)
res["adamw triton inplace"] = (bench(lambda: adamw_step_(p, g, m, v, sc, 0.9, 0.95, 1e-8, 0.1)), 14)
def adam_inplace(p, g, m, v, lr):
    m32 = m.float().lerp(g.float(), 0.1); v32 = v.float() * 0.95 + 0.05 * g.float() ** 2
    u = m32 / (v32.sqrt() + 1e-8) + 0.1 * p.float()
    p.copy_((p.float() - lr * u).to(bf)); m.copy_(m32.to(bf)); v.copy_(v32.to(bf))
f3 = torch.compile(adam_inplace)
res["adamw compile inplace"] = (bench(lambda: f3(p, g, m, v, lr)), 14)
res["adamw compile inplace chunked"] = (bench(lambda: [f3(a, b, c, d, lr) for a, b, c, d in zip(pc, gc, mc, v.split(CH))]), 14)
for k, (ms, bpp) in res.items():
    fl = n * bpp / bw * 1e3
    print(f"{k:38s} {ms:7.2f} ms floor {fl:5.2f} frac {fl/ms:4.2f}", flush=True)
