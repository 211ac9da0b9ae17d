"""An interaction for the fault tests (``tests/trainer/test_faults.py``): it answers every model
turn, first waiting while the file ``hold`` (from the sample's ``interaction_kwargs``) exists,
awaiting as a slow tool or a remote user does, with ``<hold>.waiting`` touched meanwhile. So a
test can act while rank 0 is inside a multi-turn step's tool/interaction turn."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

from megarl.tools.interactions.base import BaseInteraction


class HoldInteraction(BaseInteraction):
    async def generate_response(self, instance_id, messages, **kwargs):
        hold = kwargs.get("hold")
        while hold and os.path.exists(hold):
            Path(f"{hold}.waiting").touch()
            await asyncio.sleep(0.1)
        return False, "go on", 0.0, {}
