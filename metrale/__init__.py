"""met: a fast inference engine and OpenAI-compatible server for open-weight language models."""

from metrale.messages.outputs import CompletionOutput, RequestOutput
from metrale.messages.sampling_params import SamplingParams

__version__ = "0.1.0"


def __getattr__(name):
    # LLM pulls in torch and transformers; import it only when asked for.
    if name == "LLM":
        from metrale.entrypoints.llm import LLM

        return LLM
    raise AttributeError(name)


__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput"]
