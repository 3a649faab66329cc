"""The console: the `shardwise` command line (`cli`), its tables (`report`), figures
(`plots`) and progress bar (`progress`). Nothing below it prints.
"""
