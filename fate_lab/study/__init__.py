"""What the notebooks call: analysis of the paper's observations, tables, plots, widgets,
benchmark helpers, the hardware tables and the notebook runner.
"""
