#pragma once
namespace spes {
// `spes-engine local CONFIG [--set section.key=value]... [--resume]`: coordinator + every node
// of the config as separate processes on this machine (see local.cpp).
int local_main(int argc, char** argv);
}  // namespace spes
