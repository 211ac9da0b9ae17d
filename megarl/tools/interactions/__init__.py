"""Interactions: a scripted user turn between model turns (``interaction_config_path``), as
verl's ``verl/interactions/`` (verl 0.8; verl 0.9.1 no longer ships them).

- :mod:`.base`: ``BaseInteraction`` (verl's async methods and returns).
- :mod:`.gsm8k_interaction`: ``Gsm8kInteraction``, feedback on a wrong GSM8K answer.
- :mod:`.registry`: ``load_interactions`` (verl's interaction YAML).
"""
