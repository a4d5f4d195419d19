"""Disaggregated prefill/decode (PD): a prefill server hands each prompt's KV to a decode server.

transfer.py is the KV transport between the two (see its module docstring for the wire).
"""
