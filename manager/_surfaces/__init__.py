"""The surfaces: the command line and the Orbax, T5X and SpeechBrain faces, on the public API of
the core floor."""
