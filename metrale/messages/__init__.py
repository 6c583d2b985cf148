"""The plain types that cross layer and process boundaries: sampling parameters, the step plan
and its result, request outputs and the errors a caller can act on. They import nothing else
from metrale, so every layer of the package may use them."""
