"""placeholder"""


def script(row, seed):
    return None
