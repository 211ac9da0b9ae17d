"""Command-line applications (``megarl convert``, ``plan``, ``data``, ``tracking``, demos).

Libraries below (``megarl.models``, ``megarl.rollout``, ...) carry no argument parsing; each
module here exposes ``main(argv: list[str]) -> int`` and ``megarl.cli`` imports it directly.
"""
