"""pyddp"""
