// Command mkimage writes the node test's two images into one OCI tarball for
// `ctr images import`, with no registry: one layer with a static BusyBox and
// the probe program, tagged
//
//   - registry.k8s.io/pause:3.10, which only sleeps: containerd's sandbox
//     image and the scheduler's default reservation image, neither of which
//     can be pulled here;
//   - localhost/gpufrac/probe:1, whose containers run the probe (or a shell).
//
// Both set the environment NVIDIA's CUDA images set (NVIDIA_VISIBLE_DEVICES
// =all): what the node agent must keep from every container it did not
// grant a GPU.
//
// Usage: mkimage BUSYBOX PROBE OUT.tar
package main

import (
	"archive/tar"
	"bytes"
	"fmt"
	"io"
	"os"
	"runtime"
	"time"

	"github.com/google/go-containerregistry/pkg/name"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/empty"
	"github.com/google/go-containerregistry/pkg/v1/mutate"
	"github.com/google/go-containerregistry/pkg/v1/tarball"
)

// applets are the BusyBox commands the tests' containers call by name.
var applets = []string{"sh", "sleep", "cat", "env", "ls", "echo", "sort", "grep", "id"}

func main() {
	if len(os.Args) != 4 {
		fmt.Fprintln(os.Stderr, "usage: mkimage BUSYBOX PROBE OUT.tar")
		os.Exit(2)
	}
	if err := run(os.Args[1], os.Args[2], os.Args[3]); err != nil {
		fmt.Fprintln(os.Stderr, "mkimage:", err)
		os.Exit(1)
	}
}

func run(busybox, probe, out string) error {
	layer, err := rootfs(busybox, probe)
	if err != nil {
		return err
	}
	base, err := mutate.AppendLayers(empty.Image, layer)
	if err != nil {
		return err
	}
	images := map[name.Tag]v1.Image{}
	for ref, cfg := range map[string]v1.Config{
		"registry.k8s.io/pause:3.10": {Entrypoint: []string{"/bin/sleep", "2147483647"}},
		"localhost/gpufrac/probe:1":  {Entrypoint: []string{"/bin/probe"}},
	} {
		// As NVIDIA's CUDA images do: every container of them asks for
		// all GPUs unless something on the node says otherwise.
		cfg.Env = []string{"PATH=/bin", "NVIDIA_VISIBLE_DEVICES=all", "NVIDIA_DRIVER_CAPABILITIES=compute,utility", "CUDA_VERSION=13.0.0"}
		img, err := mutate.Config(base, cfg)
		if err != nil {
			return err
		}
		cf, err := img.ConfigFile()
		if err != nil {
			return err
		}
		cf.OS, cf.Architecture = "linux", runtime.GOARCH
		if img, err = mutate.ConfigFile(img, cf); err != nil {
			return err
		}
		tag, err := name.NewTag(ref)
		if err != nil {
			return err
		}
		images[tag] = img
	}
	return tarball.MultiWriteToFile(out, images)
}

// rootfs is the one layer: /bin with BusyBox, its applets and the probe,
// and the directories a runtime mounts over.
func rootfs(busybox, probe string) (v1.Layer, error) {
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	mtime := time.Unix(0, 0)
	for _, d := range []struct {
		name string
		mode int64
	}{{"bin/", 0o755}, {"dev/", 0o755}, {"proc/", 0o755}, {"sys/", 0o755}, {"run/", 0o755}, {"etc/", 0o755}, {"tmp/", 0o1777}} {
		if err := tw.WriteHeader(&tar.Header{Typeflag: tar.TypeDir, Name: d.name, Mode: d.mode, ModTime: mtime}); err != nil {
			return nil, err
		}
	}
	for _, f := range []struct{ src, name string }{{busybox, "bin/busybox"}, {probe, "bin/probe"}} {
		data, err := os.ReadFile(f.src)
		if err != nil {
			return nil, err
		}
		if err := tw.WriteHeader(&tar.Header{Typeflag: tar.TypeReg, Name: f.name, Mode: 0o755, Size: int64(len(data)), ModTime: mtime}); err != nil {
			return nil, err
		}
		if _, err := tw.Write(data); err != nil {
			return nil, err
		}
	}
	for _, a := range applets {
		if err := tw.WriteHeader(&tar.Header{Typeflag: tar.TypeSymlink, Name: "bin/" + a, Linkname: "busybox", Mode: 0o777, ModTime: mtime}); err != nil {
			return nil, err
		}
	}
	if err := tw.Close(); err != nil {
		return nil, err
	}
	data := buf.Bytes()
	return tarball.LayerFromOpener(func() (io.ReadCloser, error) { return io.NopCloser(bytes.NewReader(data)), nil })
}
