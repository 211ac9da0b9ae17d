"""Reward files the tests write and load by path (verl's signature, no megarl imports)."""

CUSTOM = """
import os
import time

import numpy  # at load, not inside a call: its first import took past the 1 s timeout under load


def my_score(data_source, solution_str, ground_truth, extra_info=None, scale=1.0, **kwargs):
    if "boom" in solution_str:
        raise ValueError("cannot parse " + solution_str + "\\nsecond line")
    if "sleep" in solution_str:
        time.sleep(600)
    if "die" in solution_str:
        os._exit(3)
    if "text" in solution_str:
        return "not a number"
    if data_source == "plain":
        return 1 if solution_str == ground_truth else 0
    if data_source == "bool":  # verl counts a bool as 1.0 / 0.0
        return solution_str == ground_truth
    if data_source == "numpy bool":
        return {"score": numpy.bool_(solution_str == ground_truth)}
    return {
        "score": scale * len(solution_str),
        "length": len(solution_str),
        "exact": solution_str == ground_truth,
        "tag": "t" + str(len(solution_str)),
    }
"""

RECORDING = """
import os


def compute_score(data_source, solution_str, ground_truth, extra_info=None, log=None):
    with open(log, "a") as f:
        f.write(f"{extra_info['i']} {os.environ.get('RANK', '-')}\\n")
    if solution_str == "boom":
        raise RuntimeError("bad sample")
    return float(extra_info["i"])
"""
