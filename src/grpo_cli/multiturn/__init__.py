"""Multi-turn rollouts: the policy calls tools (tools.py, builtin_tools.py) or acts in an
environment, reads the results and goes on; only the tokens it sampled are trained on."""
