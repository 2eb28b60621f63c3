"""The tables of README.md from the runs' JSON: time per step with each run's first step left out,
and the step's wait for the reduction (sync_s, mean over every step of the run).

    python3 table.py     # buckets/<setting>/<round>/<mb25|mb4|base>/..., then wait/<round>/<config>/...

Each pair's order (which size ran first) is in FIRST, from the run scripts.
"""
import json, glob, os, collections

HERE = os.path.dirname(os.path.abspath(__file__))


def steady_and_sync(f):
    d = json.load(open(f))
    tk = list(d['time_by_kind'].values())
    steady = (sum(t['total_s'] for t in tk) - tk[0]['first_s']) / (d['steps_done'] - 1)
    return steady, (d.get('metrics') or {}).get('sync_s.mean'), d['final_val_loss']


# Which size ran first in each round (run.sh, run2.sh, run3.sh, run4.sh): rounds 1 and 2 at 1 Gbit/s ran
# every 25 MB run before every 4 MB one; rounds 3 and 4 ran each method's pair back to back.
FIRST = {('2x1-1gbit', 'r1'): '25', ('2x1-1gbit', 'r2'): '25', ('2x1-1gbit', 'r3'): '4',
         ('2x1-1gbit', 'r4'): '4', ('2x1-100mbit', 'r1'): '25', ('2x1-100mbit', 'r2'): '4',
         ('8x1-1gbit', 'r1'): '25', ('8x1-1gbit', 'r2'): '4', ('8x1-1gbit', 'r3'): '25',
         ('8x1-1gbit', 'r4'): '4', ('8x1-1gbit', 'r5'): '25', ('8x1-1gbit', 'r6'): '4'}
root = os.path.join(HERE, 'buckets')
runs = collections.defaultdict(dict)
for f in sorted(glob.glob(root + '/*/r*/*/*/*.json')):
    p = f[len(root):].strip('/').split('/')
    runs[(p[0], os.path.basename(f).split('_s0')[0])][(p[1], p[2])] = steady_and_sync(f)
for setting in sorted({s for s, _ in runs}):
    print(f'\n### {setting}\n')
    print('| method | round (first) | 25 MB: ms/step | 4 MB: ms/step | 4 MB against 25 MB | step waits, 25 MB | 4 MB |')
    print('|---|---|---:|---:|---:|---:|---:|')
    means = {}
    for (s, meth), v in sorted(runs.items()):
        if s != setting:
            continue
        for r in sorted({r for r, _ in v}):
            if (r, 'base') in v:
                print(f'| {meth} | {r} | {1e3 * v[(r, "base")][0]:,.0f} | | | | |')
                continue
            a, b = v.get((r, 'mb25')), v.get((r, 'mb4'))
            if not a or not b:
                continue
            means.setdefault(meth, []).append(100 * (b[0] / a[0] - 1))
            print(f'| {meth} | {r} ({FIRST[(s, r)]} MB) | {1e3 * a[0]:,.0f} | {1e3 * b[0]:,.0f} '
                  f'| {100 * (b[0] / a[0] - 1):+.1f}% | {1e3 * a[1]:,.0f} | {1e3 * b[1]:,.0f} |')
    print('\n' + '; '.join(f'{m}: mean {sum(v) / len(v):+.1f}% over {len(v)} pairs' for m, v in means.items()))

print('\n### The wait mode (wait/), 2x1-1gbit, 40 steps\n')
print('| run | round 1: ms/step | step waits | round 2: ms/step | step waits |')
print('|---|---:|---:|---:|---:|')
cells = collections.defaultdict(dict)
for f in sorted(glob.glob(os.path.join(HERE, 'wait/r*/*/*/*.json'))):
    p = f.split('/')
    cells[(p[-3], os.path.basename(f).split('_s0')[0])][p[-4]] = steady_and_sync(f)
for (cfg, meth), v in sorted(cells.items()):
    row = ' | '.join(f"{1e3 * v[r][0]:,.0f} | {1e3 * v[r][1]:,.0f}" if v[r][1] else f"{1e3 * v[r][0]:,.0f} | "
                     for r in ('r1', 'r2'))
    print(f'| {meth} {cfg} | {row} |')
