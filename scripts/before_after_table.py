"""The table of scripts/device_before_after.sh: each configuration's median over rounds, before and
after, and after / before. python scripts/before_after_table.py OUT_DIR"""
import glob
import json
import os
import statistics
import sys


def _load(pattern: str) -> list:
    docs = []
    for path in sorted(glob.glob(pattern)):
        with open(path) as f:
            docs.append(json.load(f))
    return docs


def _median(values: list):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def _fmt(v, digits=2):
    return "-" if v is None else f"{v:.{digits}f}"


def main(out: str) -> None:
    rows = []
    for kind, key_of, metrics in (
            ("step", lambda c: (c.get("name"), c.get("set"), c.get("dtype"), c.get("mode")),
             ("median_ms", "back_to_back_ms", "host_ms")),
            ("train", lambda r: (r.get("mode"),), ("step_ms", "loop_step_ms"))):
        values: dict = {}
        copy = {}
        for which in ("before", "after"):
            for doc in _load(os.path.join(out, f"{kind}_{which}_*.json")):
                records = doc.get("cases") if kind == "step" else doc.get("records", doc.get("modes", []))
                if kind == "step" and doc.get("bandwidth"):
                    copy.setdefault(which, []).append((doc["bandwidth"].get("copy") or {}).get("gbps"))
                for rec in records or []:
                    if rec.get("skipped") or rec.get("error"):
                        continue
                    for m in metrics:
                        values.setdefault((key_of(rec), m), {}).setdefault(which, []).append(rec.get(m))
        for which, gbps in copy.items():
            print(f"{kind} {which}: copy bandwidth {_fmt(_median(gbps), 0)} GB/s over {len(gbps)} runs")
        for (key, m), by in sorted(values.items(), key=lambda kv: str(kv[0])):
            b, a = _median(by.get("before", [])), _median(by.get("after", []))
            ratio = a / b if a and b else None
            rows.append((kind, "/".join(str(k) for k in key if k is not None), m, _fmt(b), _fmt(a), _fmt(ratio, 3),
                         len(by.get("before", [])), len(by.get("after", []))))
    print(f"{'bench':6} {'configuration':58} {'metric':16} {'before':>9} {'after':>9} {'a/b':>7} n")
    for r in rows:
        print(f"{r[0]:6} {r[1][:58]:58} {r[2]:16} {r[3]:>9} {r[4]:>9} {r[5]:>7} {r[6]}/{r[7]}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "/tmp/out")
