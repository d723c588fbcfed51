"""framekv.graphs"""
