// Package reservation tells reservation pods which physical GPU they hold.
// A reservation pod requests nvidia.com/gpu: 1 so the device plugin gives
// it a whole GPU that fractions then share; which one only the kubelet
// knows, through its PodResources API. The agent reads that and writes the
// GPU's UUID onto the pod for the scheduler.
package reservation

import (
	"context"
	"encoding/json"
	"fmt"
	"maps"
	"slices"
	"strings"
	"sync"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes"
	"k8s.io/klog/v2"
	podresourcesv1 "k8s.io/kubelet/pkg/apis/podresources/v1"

	"github.com/gpufrac/gpufrac/pkg/api"
	"github.com/gpufrac/gpufrac/pkg/ledgers"
)

// DefaultSocket is the kubelet's PodResources socket.
const DefaultSocket = "/var/lib/kubelet/pod-resources/kubelet.sock"

// Source answers which GPU device IDs each pod holds: the kubelet
// (Kubelet), or the agent itself where no kubelet runs (Simulated).
type Source interface {
	// Devices maps namespace/name to the nvidia.com/gpu device IDs of the
	// pod's containers; pods are the node's reservation pods as the API
	// shows them now.
	Devices(ctx context.Context, pods []corev1.Pod) (map[string][]string, error)
}

// Kubelet reads devices from the kubelet's PodResources API.
type Kubelet struct {
	client podresourcesv1.PodResourcesListerClient
	conn   *grpc.ClientConn
}

// DialKubelet connects to the PodResources socket.
func DialKubelet(socket string) (*Kubelet, error) {
	conn, err := grpc.NewClient("unix://"+socket, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		return nil, fmt.Errorf("kubelet PodResources socket %s: %w", socket, err)
	}
	return &Kubelet{client: podresourcesv1.NewPodResourcesListerClient(conn), conn: conn}, nil
}

// Close closes the connection.
func (k *Kubelet) Close() error { return k.conn.Close() }

// Devices lists every pod's nvidia.com/gpu devices, as the kubelet's
// device manager allocated them.
func (k *Kubelet) Devices(ctx context.Context, _ []corev1.Pod) (map[string][]string, error) {
	resp, err := k.client.List(ctx, &podresourcesv1.ListPodResourcesRequest{})
	if err != nil {
		return nil, fmt.Errorf("kubelet PodResources List: %w", err)
	}
	out := map[string][]string{}
	for _, pod := range resp.GetPodResources() {
		for _, c := range pod.GetContainers() {
			for _, d := range c.GetDevices() {
				if d.GetResourceName() == api.ResourceGPU {
					key := pod.GetNamespace() + "/" + pod.GetName()
					out[key] = append(out[key], d.GetDeviceIds()...)
				}
			}
		}
	}
	return out, nil
}

// Allocated are the nvidia.com/gpu devices the kubelet's device manager
// allocated to the node's pods in namespaces (reservation pods: gpufrac's,
// KAI's), by device ID (a shared replica "GPU-x::2" as its GPU). A GPU
// allocated to any other pod (a whole-GPU workload) holds no share.
func (k *Kubelet) Allocated(ctx context.Context, namespaces ...string) (map[string]bool, error) {
	byPod, err := k.Devices(ctx, nil)
	if err != nil {
		return nil, err
	}
	out := map[string]bool{}
	for pod, ids := range byPod {
		if ns, _, _ := strings.Cut(pod, "/"); !slices.Contains(namespaces, ns) {
			continue
		}
		for _, id := range ids {
			id, _, _ = strings.Cut(id, "::")
			out[id] = true
		}
	}
	return out, nil
}

// ContainerDevices are the NVIDIA device IDs the kubelet's device
// manager allocated to one container of a pod.
func (k *Kubelet) ContainerDevices(ctx context.Context, namespace, pod, container string) ([]string, error) {
	resp, err := k.client.List(ctx, &podresourcesv1.ListPodResourcesRequest{})
	if err != nil {
		return nil, fmt.Errorf("kubelet PodResources List: %w", err)
	}
	var out []string
	for _, p := range resp.GetPodResources() {
		if p.GetNamespace() != namespace || p.GetName() != pod {
			continue
		}
		for _, c := range p.GetContainers() {
			if c.GetName() != container {
				continue
			}
			for _, d := range c.GetDevices() {
				// nvidia.com/gpu, and what NVIDIA's plugin serves besides:
				// renamed shared GPUs (nvidia.com/gpu.shared), MIG devices.
				if strings.HasPrefix(d.GetResourceName(), "nvidia.com/") {
					out = append(out, d.GetDeviceIds()...)
				}
			}
		}
	}
	return out, nil
}

// Simulated plays the device plugin where no kubelet runs (local clusters):
// it hands each reservation pod a GPU of the simulated inventory that no
// other reservation pod on the node holds.
type Simulated struct {
	GPUs []string // UUIDs, in index order
}

// Annotator writes GPU UUIDs onto the node's reservation pods.
type Annotator struct {
	Client    kubernetes.Interface
	Node      string
	Namespace string
	Source    Source

	mu       sync.Mutex
	standing map[string]api.SharesHeld
	held     map[string]bool
	byGroup  map[string]string
}

// Held is what the last Sync found: the GPUs this node's reservation pods
// hold (for any group), by UUID, which fractions share through MPS. Nil
// when the last Sync could not read the pods or their devices: unknown,
// which is not "none".
func (a *Annotator) Held() map[string]bool {
	a.mu.Lock()
	defer a.mu.Unlock()
	return maps.Clone(a.held)
}

// HeldByGroup is what the last Sync found: by GPU group, the GPU the
// group's reservation pod holds as the kubelet allocated it (a pod being
// deleted still holds its GPU until it is gone). Nil when the last Sync
// could not read the pods or their devices. A share placed by gpufrac's
// scheduler is held only by its own group's pod: the device plugin may
// give a GPU whose reservation pod was deleted under its shares to
// another group's new reservation pod, and the old shares would then run
// beside the new ones, booked elsewhere.
func (a *Annotator) HeldByGroup() map[string]string {
	a.mu.Lock()
	defer a.mu.Unlock()
	return maps.Clone(a.byGroup)
}

// Standing is what the last Sync found: by GPU UUID, the GPUs standing
// reservation pods hold for shares (ledgers.StandingGroup), each with
// what the scheduler says annotation shares hold of it. A GPU whose pod
// lacks a readable api.SharesHeldAnnotation is left out: what it holds
// is unknown, so it offers claims nothing.
func (a *Annotator) Standing() map[string]api.SharesHeld {
	a.mu.Lock()
	defer a.mu.Unlock()
	return maps.Clone(a.standing)
}

func standingOf(ctx context.Context, pods []corev1.Pod) map[string]api.SharesHeld {
	out := map[string]api.SharesHeld{}
	for i := range pods {
		p := &pods[i]
		r, _ := api.ReservationOf(p)
		uuid := r.GPU
		if !ledgers.IsStanding(r.Group) || uuid == "" || p.DeletionTimestamp != nil || p.Status.Phase == corev1.PodFailed {
			continue
		}
		if !r.HeldSet {
			continue // the scheduler has not said yet
		}
		held, err := api.ParseSharesHeld(r.Held)
		if err != nil {
			klog.FromContext(ctx).Error(err, "Standing reservation pod: its GPU is offered to no claim", "pod", klog.KObj(p))
			continue
		}
		out[uuid] = held
	}
	return out
}

// Sync annotates every reservation pod on the node that lacks its GPU's
// UUID and has one assigned. It returns how many it annotated.
func (a *Annotator) Sync(ctx context.Context) (int, error) {
	logger := klog.FromContext(ctx)
	// What a failed read leaves is no offer at all, not the last one.
	a.mu.Lock()
	a.standing, a.held, a.byGroup = nil, nil, nil
	a.mu.Unlock()
	pods, err := a.Client.CoreV1().Pods(a.Namespace).List(ctx, metav1.ListOptions{
		FieldSelector: fields.OneTermEqualSelector("spec.nodeName", a.Node).String(),
	})
	if err != nil {
		return 0, fmt.Errorf("list reservation pods on %s: %w", a.Node, err)
	}
	standing := standingOf(ctx, pods.Items)
	a.mu.Lock()
	a.standing = standing
	a.mu.Unlock()
	devices, err := a.Source.Devices(ctx, pods.Items)
	if err != nil {
		return 0, err
	}
	held := map[string]bool{}
	byGroup := map[string]string{}
	for i := range pods.Items {
		// A pod being deleted still holds its GPU until it is gone: its
		// tenants may run on.
		pod := &pods.Items[i]
		r, _ := api.ReservationOf(pod)
		if r.GPU != "" {
			held[r.GPU] = true
		}
		ids := devices[pod.Namespace+"/"+pod.Name]
		for _, id := range ids {
			held[id] = true
		}
		if len(ids) == 1 && r.Group != "" {
			id, _, _ := strings.Cut(ids[0], "::")
			byGroup[r.Group] = id
		}
	}
	a.mu.Lock()
	a.held, a.byGroup = held, byGroup
	a.mu.Unlock()
	annotated := 0
	for i := range pods.Items {
		pod := &pods.Items[i]
		if r, _ := api.ReservationOf(pod); pod.DeletionTimestamp != nil || r.GPU != "" {
			continue
		}
		ids := devices[pod.Namespace+"/"+pod.Name]
		switch len(ids) {
		case 0:
			continue // the kubelet has not admitted it yet
		case 1:
		default:
			logger.Info("Reservation pod holds several GPUs; it should request exactly one", "pod", klog.KObj(pod), "devices", ids)
			continue
		}
		if err := annotate(ctx, a.Client, pod, ids[0]); err != nil {
			return annotated, err
		}
		logger.V(2).Info("Annotated reservation pod with its GPU", "pod", klog.KObj(pod), "gpu", ids[0])
		annotated++
	}
	return annotated, nil
}

func annotate(ctx context.Context, client kubernetes.Interface, pod *corev1.Pod, uuid string) error {
	patch, err := json.Marshal(map[string]any{"metadata": map[string]any{
		"annotations":     api.ReservedGPUWrite(uuid).MergePatch(),
		"resourceVersion": pod.ResourceVersion, // never overwrite a concurrent writer
	}})
	if err != nil {
		return err
	}
	if _, err := client.CoreV1().Pods(pod.Namespace).Patch(ctx, pod.Name, types.MergePatchType, patch, metav1.PatchOptions{}); err != nil {
		return fmt.Errorf("annotate reservation pod %s/%s with GPU %s: %w", pod.Namespace, pod.Name, uuid, err)
	}
	return nil
}

// Devices plays the device plugin: it keeps the GPUs pods already hold
// and gives each new pod the lowest free one.
func (s *Simulated) Devices(_ context.Context, pods []corev1.Pod) (map[string][]string, error) {
	out := map[string][]string{}
	var held []string
	for _, p := range pods {
		if r, _ := api.ReservationOf(&p); r.GPU != "" && p.DeletionTimestamp == nil {
			uuid := r.GPU
			held = append(held, uuid)
			out[p.Namespace+"/"+p.Name] = []string{uuid}
		}
	}
	pods = slices.Clone(pods)
	slices.SortFunc(pods, func(a, b corev1.Pod) int { return a.CreationTimestamp.Compare(b.CreationTimestamp.Time) })
	for _, p := range pods {
		key := p.Namespace + "/" + p.Name
		if out[key] != nil || p.DeletionTimestamp != nil {
			continue
		}
		for _, uuid := range s.GPUs {
			if !slices.Contains(held, uuid) {
				held = append(held, uuid)
				out[key] = []string{uuid}
				break
			}
		}
	}
	return out, nil
}
