"""The code sandbox: model-written programs run isolated (runner.py supervises, child.py runs inside)."""
