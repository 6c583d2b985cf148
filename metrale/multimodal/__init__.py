"""Images and video: the media fetch policy, fetching, decoding, and the processing the engine runs."""
