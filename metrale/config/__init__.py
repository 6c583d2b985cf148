"""Configuration: EngineArgs and the frozen configs derived from it."""
