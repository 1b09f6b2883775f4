"""Per bench case, NEW / BASE of the FP8 kernel's median time, taking the smaller median of each
binary's two runs. Usage: bench_ratio.py BASE1.json BASE2.json NEW1.json NEW2.json (kvaudit bench --json)."""
import json
import sys

def medians(paths):
    best = {}
    for path in paths:
        for case in json.load(open(path))["cases"]:
            if "fp8" in case:
                name, t = case["name"], case["fp8"]["median_us"]
                best[name] = min(best.get(name, t), t)
    return best

base, new = medians(sys.argv[1:3]), medians(sys.argv[3:5])
worst = 0.0
for name in base:
    if name in new:
        r = new[name] / base[name]
        worst = max(worst, r)
        print(f"{r:6.3f}  base {base[name]:9.2f} us  new {new[name]:9.2f} us  {name}")
print(f"cases {len(base)}, worst new/base {worst:.3f}")
