"""gqakit.uptrain"""
