"""Small models shared by the tests, the demo and the benchmarks."""
import math

import torch
import torch.nn as nn
import torch.nn.functional as F


class MLP(nn.Module):
    def __init__(self, d_in=16, d_hidden=32, d_out=4):
        super().__init__()
        self.fc1 = nn.Linear(d_in, d_hidden)
        self.fc2 = nn.Linear(d_hidden, d_hidden)
        self.fc3 = nn.Linear(d_hidden, d_out)

    def forward(self, batch):
        x, y = batch
        h = torch.relu(self.fc2(torch.relu(self.fc1(x))))
        return F.mse_loss(self.fc3(h), y)
