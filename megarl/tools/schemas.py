"""The OpenAI function-tool schema and the tool response, as verl 0.9.1's ``verl/tools/schemas.py``.

The same pydantic models with the same fields and defaults (written from verl's behaviour), so
a verl user's ``OpenAIFunctionToolSchema.model_validate(...)``, ``tool_schema.function.name``,
``model_dump(exclude_unset=True, exclude_none=True)`` and ``ToolResponse(text=...)`` work after
changing ``verl.tools.schemas`` to ``megarl.tools.schemas``. As in verl, unknown keys are
ignored: a property's ``items`` is dropped from the schema the prompt shows (verl's models have
no such field either).
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, Field, model_validator

__all__ = [
    "OpenAIFunctionCallSchema",
    "OpenAIFunctionParametersSchema",
    "OpenAIFunctionParsedSchema",
    "OpenAIFunctionPropertySchema",
    "OpenAIFunctionSchema",
    "OpenAIFunctionToolCall",
    "OpenAIFunctionToolSchema",
    "ToolResponse",
]


class OpenAIFunctionPropertySchema(BaseModel):
    """One parameter: its JSON type (a list for unions such as ``["integer", "number"]``)."""

    type: str | list[str]
    description: str | None = None
    enum: list[Any] | None = None


class OpenAIFunctionParametersSchema(BaseModel):
    """The parameters object of a function."""

    type: str
    properties: dict[str, OpenAIFunctionPropertySchema]
    required: list[str] = Field(default_factory=list)


def _no_parameters() -> OpenAIFunctionParametersSchema:
    return OpenAIFunctionParametersSchema(type="object", properties={}, required=[])


class OpenAIFunctionSchema(BaseModel):
    """A function: name, description, parameters."""

    name: str
    description: str
    parameters: OpenAIFunctionParametersSchema = Field(default_factory=_no_parameters)
    strict: bool = False


class OpenAIFunctionToolSchema(BaseModel):
    """A tool in OpenAI format: ``{"type": "function", "function": {...}}``."""

    type: str
    function: OpenAIFunctionSchema


class OpenAIFunctionParsedSchema(BaseModel):
    """A parsed call whose arguments are still JSON text."""

    name: str
    arguments: str


class OpenAIFunctionCallSchema(BaseModel):
    """A parsed call with decoded arguments."""

    name: str
    arguments: dict[str, Any]

    @staticmethod
    def from_openai_function_parsed_schema(
        parsed_schema: OpenAIFunctionParsedSchema,
    ) -> tuple[OpenAIFunctionCallSchema, bool]:
        """The call with its arguments decoded, and whether decoding failed (then ``{}``;
        arguments that are valid JSON but not an object count as a failure, as in verl)."""
        try:
            arguments = json.loads(parsed_schema.arguments)
        except json.JSONDecodeError:
            arguments = None
        if not isinstance(arguments, dict):
            return OpenAIFunctionCallSchema(name=parsed_schema.name, arguments={}), True
        return OpenAIFunctionCallSchema(name=parsed_schema.name, arguments=arguments), False


class OpenAIFunctionToolCall(BaseModel):
    """A tool call as an assistant message carries it."""

    id: str
    type: Literal["function"] = "function"
    function: OpenAIFunctionCallSchema


class ToolResponse(BaseModel):
    """What a tool returns to the model: text and/or images and videos (lists, as in verl; an
    explicit None is accepted here, verl refuses it)."""

    text: str | None = None
    image: list[Any] | None = None
    video: list[Any] | None = None

    @model_validator(mode="before")
    @classmethod
    def _media_are_lists(cls, values: Any) -> Any:
        if isinstance(values, dict):
            for key in ("image", "video"):
                if values.get(key) is not None and not isinstance(values[key], list):
                    raise ValueError(
                        f"ToolResponse.{key} must be a list, got {type(values[key]).__name__}: "
                        f"wrap a single one as [{key}]"
                    )
        return values

    def is_empty(self) -> bool:
        """No text, no image, no video."""
        return not self.text and not self.image and not self.video

    def is_text_only(self) -> bool:
        """Text and no media (verl returns the text itself when truthy; here a bool)."""
        return bool(self.text) and not self.image and not self.video
