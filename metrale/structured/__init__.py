"""The grammar engine of structured outputs, on xgrammar.

grammars.py: GrammarCache, the compiled grammars of one tokenizer, keyed by the spec
(messages.structured_outputs.StructuredOutputsParams), compiled in worker threads with a
timeout. matchers.py: GrammarMatchers, one xgrammar matcher per constrained request of a model
runner, and the packed token bitmask of a step's constrained rows. The sampler applies that
bitmask (kernels/token_bitmask.py) after penalties, before temperature and the filters.

xgrammar is imported on first use, never by `met --help` nor by a server that gets no
constrained request.
"""
