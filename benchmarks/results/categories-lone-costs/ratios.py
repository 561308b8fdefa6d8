"""Per-kind ratios of a `specdec bench --per-kind` results.json: python ratios.py results.json"""
import json
import statistics as s
import sys

d = json.load(open(sys.argv[1]))
rows = {}
for x in d['results']:
    rows.setdefault(x['prompt_set'].split(':')[-1], {})['off' if x['configuration'].startswith('specdec-off') else 'on'] = x
for k, v in rows.items():
    off = v['off']['tokens_per_second']['per_repetition']
    on = v['on']['tokens_per_second']['per_repetition']
    rounds = [b / a for a, b in zip(off, on)]
    print(f"{k:14s} off {[round(a, 2) for a in off]} on {[round(b, 2) for b in on]}"
          f" ratio of medians {s.median(on) / s.median(off):.3f} median of per-round {s.median(rounds):.3f}"
          f" per-round {[round(r, 2) for r in rounds]} drafted {v['on']['draft_tokens']} accepted {v['on']['accepted_tokens']}"
          f" steps {v['on']['steps']}/{v['off']['steps']} identical {v['on']['identical_to_baseline']}")
