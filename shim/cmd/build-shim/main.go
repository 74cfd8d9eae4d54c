// Command build-shim builds the nvidia-smi view library into a directory:
// go run ./shim/cmd/build-shim bin/shim
package main

import (
	"fmt"
	"os"

	"github.com/gpufrac/gpufrac/shim"
)

func main() {
	if len(os.Args) != 2 {
		fmt.Fprintln(os.Stderr, "usage: build-shim OUTDIR")
		os.Exit(2)
	}
	cc := os.Getenv("CC")
	if cc == "" {
		cc = "cc"
	}
	lib, err := shim.Build(cc, os.Args[1])
	if err != nil {
		fmt.Fprintln(os.Stderr, "error:", err)
		os.Exit(1)
	}
	fmt.Println(lib)
}
