"""Does hvd.synchronize hold the GIL? A thread waits on a big allreduce; the main thread counts."""
import threading, time, torch
import horovod.torch as hvd
hvd.init()
x = torch.ones(50_000_000)
def run(mode):
    h = hvd.allreduce_async_(x, name=f"big.{mode}", op=hvd.Sum)
    done = threading.Event()
    def waiter():
        if mode == "synchronize":
            hvd.synchronize(h)
        else:
            while not hvd.poll(h):
                time.sleep(1e-4)
            hvd.synchronize(h)
        done.set()
    t = threading.Thread(target=waiter); start = time.perf_counter(); t.start()
    n = 0; gaps = []; last = time.perf_counter()
    while not done.is_set():
        n += 1
        now = time.perf_counter(); gaps.append(now - last); last = now
    t.join()
    el = time.perf_counter() - start
    print(f"rank {hvd.rank()} {mode}: {el*1e3:.0f} ms, main-thread iterations {n}, longest gap {max(gaps)*1e3:.1f} ms", flush=True)
for m in ["synchronize", "poll", "synchronize", "poll"]:
    run(m)
