"""Built-in specs, data only: models/, hardware/, clusters/, rules/, runtimes/.

A built-in name on the command line (`--model llama3-70b`) is the file of that name
here (`configs/models/llama3-70b.yaml`).
"""
