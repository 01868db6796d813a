"""Offline speech data for the CTC phoneme-recognition experiment: synthetic English speech from eSpeak NG.

`espeak` (synthesis and phonemes), `phonemes` (the fixed inventory), `features` (log-mel filterbanks),
`sentences` (standard-library docstring sentences) and `synthetic` (the `lt_synth_speech` TFDS builder).
Importing this package imports none of them, so neither TFDS nor eSpeak is loaded until needed.
"""
