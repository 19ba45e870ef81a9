"""In-place recovery (`fault.recovery=in_place`): a lost worker is replaced while the others train
on (inplace, over torchft), and a frozen replica is fenced (fence).

May import: config, data, training. Imports no Ray: the Ray side (torchft backend, the fence
task) lives in cluster/.
"""
