"""framekv.tools"""
