"""Training the demo model's draft models on the CPU: the prompt corpus, the
target's answers and features, the EAGLE-3 head and the distilled draft LM."""
