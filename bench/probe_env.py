"""One-off environment probe on the GPU machine (API surface, warnings, profiler trace format)."""
import glob, gzip, json, os, sys, time, warnings
warnings.simplefilter("always")
import jax, jax.numpy as jnp
print("jax", jax.__version__, jax.devices(), jax.default_backend())
d = jax.devices()[0]
for attr in ("compute_capability", "core_count", "device_kind", "client"):
    print(attr, getattr(d, attr, None))
with warnings.catch_warnings(record=True) as w:
    warnings.simplefilter("always")
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plgpu
    print("import warnings:", [(x.category.__name__, str(x.message)[:300]) for x in w])
print("plgpu names:", [n for n in dir(plgpu) if not n.startswith("_")])
print("pl names:", [n for n in dir(pl) if not n.startswith("_")])
import inspect
print("load sig", inspect.signature(plgpu.load)); print("store sig", inspect.signature(plgpu.store))
print("dot sig", inspect.signature(plgpu.dot))
print("pallas_call sig", inspect.signature(pl.pallas_call))
def kern(x_ref, o_ref):
    i = pl.program_id(0)
    x = plgpu.load(x_ref.at[pl.ds(i * 16, 16), pl.ds(0, 128)], mask=(jnp.arange(128) < 80)[None, :], other=0.0)
    y = plgpu.dot(x, x.T)
    plgpu.store(o_ref.at[pl.ds(i * 16, 16), :], y)
x = jnp.ones((64, 80), jnp.float16)
with warnings.catch_warnings(record=True) as w:
    warnings.simplefilter("always")
    f = jax.jit(lambda x: pl.pallas_call(kern, out_shape=jax.ShapeDtypeStruct((64, 16), jnp.float32), grid=(4,),
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=2), name="probe")(x))
    y = f(x).block_until_ready()
    print("call warnings:", [(x.category.__name__, str(x.message)[:300], x.filename) for x in w])
print("probe result", float(y[0, 0]), "expect 80")
# profiler trace format
a = jnp.ones((8192, 8192), jnp.bfloat16)
g = jax.jit(lambda a: (a @ a).sum())
g(a).block_until_ready()
tdir = "/tmp/trace_probe"
with jax.profiler.trace(tdir, create_perfetto_trace=True):
    for _ in range(3):
        g(a).block_until_ready()
files = glob.glob(tdir + "/**/*", recursive=True)
print("trace files", files)
pf = [f for f in files if f.endswith("perfetto_trace.json.gz")]
if pf:
    data = json.load(gzip.open(pf[0]))
    evs = data["traceEvents"] if isinstance(data, dict) else data
    procs = {e["pid"]: e["args"]["name"] for e in evs if e.get("ph") == "M" and e.get("name") == "process_name"}
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in evs if e.get("ph") == "M" and e.get("name") == "thread_name"}
    print("procs", procs); print("threads", threads)
    gpu = [e for e in evs if e.get("ph") == "X" and "GPU" in procs.get(e["pid"], "")]
    print("n gpu events", len(gpu))
    for e in gpu[:12]:
        print(threads.get((e["pid"], e["tid"])), e["name"][:80], e["dur"], list(e.get("args", {}).keys())[:8])
os.system("nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,power.draw,power.limit,memory.used --format=csv")
try:
    import triton; print("triton", triton.__version__)
except Exception as e: print(e)
import flax; print("flax", flax.__version__)
